"""A Hugging Face Trainer in a one-process CPU rank that checks devices (GPU_LAB_STRICT_DEVICE):
its batches go where accelerate put the model, as they do on a one-GPU server."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow  # imports transformers
pytest.importorskip("transformers")


def test_a_one_process_trainer_moves_its_batches_to_the_rank_device(monkeypatch, tmp_path):
    from accelerate.state import AcceleratorState, PartialState
    from transformers import TrainingArguments

    from gpu_lab.rank import devicecheck, hf_trainer
    from gpu_lab.rank.devicecheck import DeviceMismatch, on_device

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # what gpu_lab sets in a CPU rank
    # the property as transformers has it, put back after the test
    monkeypatch.setattr(TrainingArguments, "device", TrainingArguments.__dict__["device"])
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
        own = args.device  # one process: transformers makes a "cpu" of its own
        rank = PartialState().device  # where accelerate (and so the Trainer) puts the model
        assert own == rank and own is not rank
        hf_trainer._rank_device(TrainingArguments)
        hf_trainer._rank_device(TrainingArguments)  # once only
        assert args.device is rank
        with devicecheck.mode():
            model = torch.nn.Linear(4, 1).to(rank)
            batch = torch.randn(8, 4).to(device=args.device)  # Trainer._prepare_input
            assert on_device(model(batch))
            with pytest.raises(DeviceMismatch):  # what the Trainer's batches met before
                model(torch.randn(8, 4).to(device=own))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
