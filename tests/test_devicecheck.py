"""GPU_LAB_STRICT_DEVICE: a CPU process that refuses what a GPU refuses, a tensor left on the CPU
beside a model on its device, and lets through what CUDA lets through."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_lab.rank import devicecheck
from gpu_lab.rank.devicecheck import DeviceMismatch, on_device


@pytest.fixture
def strict():
    with devicecheck.mode():
        yield devicecheck.device()  # what acc.device is in a rank


def _model(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(dev)


def test_an_input_left_on_the_cpu_is_refused_as_a_gpu_would(strict):
    model = _model(strict)
    assert all(on_device(p) for p in model.parameters())
    with pytest.raises(DeviceMismatch, match=r"linear: a device tensor of shape \(8, 4\) met a CPU "
                                             r"tensor of shape \(256, 4\)"):
        model(torch.randn(256, 4))


@pytest.mark.parametrize("opt", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                 lambda p: torch.optim.AdamW(p, lr=1e-3),
                                 lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False)])
def test_inputs_on_the_device_train_as_usual(strict, opt):
    model = _model(strict)
    optimizer = opt(model.parameters())
    x = torch.randn(256, 4, device=strict)  # made there
    y = x.sum(1, keepdim=True)
    first = None
    for _ in range(20):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        first = first if first is not None else loss.item()
    assert on_device(loss) and loss.item() < first
    moved = torch.randn(4, 4).to(strict)  # or moved there
    assert on_device(moved) and on_device(model(moved))


def test_what_cuda_lets_cross_devices_passes(strict):
    model = _model(strict)
    out = model(torch.randn(8, 4, device=strict))
    scaled = out * torch.tensor(2.0)  # a 0-dim CPU tensor meets a device tensor
    assert on_device(scaled)
    picked = out[torch.tensor([0, 2])]  # CPU indices
    assert on_device(picked)
    out.detach()[0:2] = torch.zeros(2, 1)  # a copy across devices
    back = out.cpu()  # and off it again
    assert not on_device(back)
    with pytest.raises(DeviceMismatch):
        back + out
    made_like = torch.zeros(3, device=out.device)  # a device tensor's .device names the device
    assert on_device(made_like)
    plain = torch.zeros(3, device=torch.randn(3).device)  # a CPU tensor's does not
    assert not on_device(plain)


def test_a_prepared_loader_brings_its_batches_and_other_tensors_do_not(strict):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    acc = Accelerator(cpu=True)
    model = _model(torch.device("cpu"))  # not moved yet: prepare moves it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=16))
    assert all(on_device(p) for p in model.parameters())
    for x, y in loader:
        assert on_device(x) and on_device(y)
        acc.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    with pytest.raises(DeviceMismatch):
        F.mse_loss(model(x), torch.randn(16, 1))  # labels made on the CPU


def test_copies_keep_the_device_and_sparse_gradients_leave_it(strict):
    import copy

    devicecheck._copies_keep_their_device()  # what install() does in a rank
    model = _model(strict)
    twin = copy.deepcopy(model)  # a pruned or 16-bit copy starts so
    assert all(on_device(p) for p in twin.parameters())
    assert on_device(twin.to(torch.bfloat16)(torch.randn(2, 4, device=strict).bfloat16()))
    rows = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,))
    assert not on_device(rows.to(strict).cpu())  # a sparse tensor, copied off the device


def test_a_model_moved_to_the_cpu_takes_cpu_inputs_and_leaves_the_original(strict):
    # tutorial 12 exports copy.deepcopy(model).cpu() to ONNX: Module.cpu() swaps each
    # parameter's .data in place, and the parameter must leave the device with it
    import copy

    devicecheck._copies_keep_their_device()
    model = _model(strict)
    cpu_model = copy.deepcopy(model).cpu()
    assert not any(on_device(p) for p in cpu_model.parameters())
    assert not on_device(cpu_model(torch.randn(2, 4)))
    assert all(on_device(p) for p in model.parameters())  # the original stays on the device
    with pytest.raises(DeviceMismatch):
        model(torch.randn(2, 4))
    assert all(on_device(p) for p in cpu_model.to(strict).parameters())  # and back again
    p = next(model.parameters())
    p.grad = torch.zeros_like(p).cpu()  # .grad's setter is no .data swap: p stays where it is
    assert on_device(p)
