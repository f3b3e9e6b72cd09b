"""Glue for training frameworks, only where plain use is not enough.

``TieredAdamW`` drops into transformers' ``Trainer``, accelerate, Lightning and ``torch.compile``
as it is (see README, "With a trainer"). What is here saves work, never changes numbers:

- ``tierstore.integrations.hf``: ``TieredTrainer`` (or ``TieredTrainerMixin``) clips and
  measures the gradient norm on the optimizer's host copies instead of rewriting ``p.grad``.
"""
