"""``TieredTrainer`` with sharded state (``process_group=``, 2 gloo ranks under torchrun): the
Trainer saves ``optimizer.state_dict()`` from rank 0 alone, which holds rank 0's parameters'
state only, and loads it into every rank at resume (a tryout: the resumed run drifted by 1e-2
from the uninterrupted one, no error). ``TieredTrainer`` saves every rank's own dict and each
rank loads its own: resumed equals uninterrupted, bit for bit. (The plain ``Trainer`` now
refuses rank 0's dict on rank 1: ``tests/test_sharded_state_dict_files.py``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = r"""
import os, sys, warnings, torch, transformers
from tierstore.integrations.hf import TieredTrainer
from tierstore.optim import TieredAdamW
warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
out, steps, resume = sys.argv[1], int(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else None)

class Counting(torch.utils.data.Dataset):
    def __init__(self):
        self.tokens = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.tokens)
    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}

torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2))
args = transformers.TrainingArguments(out, max_steps=steps, per_device_train_batch_size=4, learning_rate=3e-3,
                                      lr_scheduler_type="constant", save_steps=3, report_to=[], disable_tqdm=True,
                                      use_cpu=True, seed=0, logging_steps=1)
opt = TieredAdamW(model.parameters(), lr=3e-3, process_group=True, offload="disk", disk_root=os.path.join(out, "state"),
                  host_capacity="256KiB", overwrite=True)
trainer = TieredTrainer(model=model, args=args, train_dataset=Counting(), optimizers=(opt, None))
trainer.train(resume_from_checkpoint=resume)
if trainer.args.process_index == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, "final.pt"))
opt.close()
"""


def _torchrun(script: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *args],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]


def test_a_sharded_run_resumed_through_tiered_trainer_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    _torchrun(script, str(tmp_path / "whole"), "6")
    _torchrun(script, str(tmp_path / "part"), "3")
    checkpoint = tmp_path / "part" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "optimizer.rank1-of-2.pt").is_file()
    _torchrun(script, str(tmp_path / "part"), "6", str(checkpoint))
    whole = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)
    resumed = torch.load(tmp_path / "part" / "final.pt", weights_only=True)
    different = [name for name in whole if not torch.equal(whole[name], resumed[name])]
    assert not different, different
