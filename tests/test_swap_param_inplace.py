"""Parameter offload keeps torch's autograd graph as it is: a unit's output may be changed in
place (``ReLU(inplace=True)`` after a conv or batch norm, a residual ``out += x``: torch's full
backward hooks refused both), and gradients equal a plain model's bit for bit, through residual
streams too (with full backward hooks they differed in the last bits)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_parameters

pytestmark = pytest.mark.device_modes


class BasicBlock(nn.Module):
    """torchvision's ResNet block: batch norm output changed in place twice."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        BasicBlock(8), BasicBlock(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )


def test_a_resnet_with_in_place_changes_trains_as_torch_does(device_mode: str) -> None:
    model = _resnet()
    twin = copy.deepcopy(model)
    store = SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("16MiB")]).open()
    try:
        params = offload_parameters(model, store)
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, min_offload_numel=1, fused=True)
        reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 10, (4,), generator=generator)
            for net, optimizer in ((model, opt), (twin, reference)):
                nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            params.mark_step()
        opt.close()
        params.detach()
        for ours, theirs in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
            assert torch.equal(ours, theirs)  # weights and batch norm statistics
    finally:
        store.close()


@pytest.mark.parametrize("checkpointing", [None, False, True])
def test_a_residual_stream_gets_a_plain_models_gradients(checkpointing: bool | None, device_mode: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    twin = copy.deepcopy(model)
    store = SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("256MiB")]).open()
    try:
        offload_parameters(model, store)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            for net in (model, twin):
                net(input_ids=ids, labels=ids).loss.backward()
        pairs = [(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True) if q.grad is not None]
        assert pairs
        for ours, theirs in pairs:
            assert torch.equal(ours.grad, theirs.grad)
    finally:
        store.close()
