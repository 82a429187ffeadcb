"""Structured pruning removes channels for real: fewer parameters, narrower feature maps, and a
latency measured side by side with the unpruned model in the same run."""
import pytest
import torch
from torch import nn

from gpu_lab.cases import pruning
from gpu_lab.models.tiny import TinyCNN, TinyResNet


def _conv_params(cin, cout, k=3):
    return cin * cout * k * k  # bias=False in tiny_cnn


@pytest.mark.slow  # over half a second
def test_pruned_model_is_smaller_narrower_and_timed_beside_the_original():
    torch.manual_seed(0)
    model = TinyCNN(10, width=32).eval()
    pruned = pruning.prune_channels(model, 0.5).eval()

    assert pruning.conv_widths(model) == [32, 64, 128]
    assert pruning.conv_widths(pruned) == [16, 32, 64]
    # conv weights + BatchNorm (weight, bias) + the head, at the pruned widths
    expected = (_conv_params(3, 16) + _conv_params(16, 32) + _conv_params(32, 64)
                + 2 * (16 + 32 + 64) + 64 * 10 + 10)
    assert pruning.count_params(pruned) == expected
    assert pruning.count_params(model) == (_conv_params(3, 32) + _conv_params(32, 64)
                                           + _conv_params(64, 128) + 2 * (32 + 64 + 128)
                                           + 128 * 10 + 10)

    # the pruned forward really computes fewer channels: every conv's output map is half as wide
    shapes = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: shapes.__setitem__(n, tuple(o.shape)))
             for n, m in pruned.named_modules() if isinstance(m, nn.Conv2d)]
    x = torch.randn(64, 3, 32, 32)
    with torch.no_grad():
        out = pruned(x)
    for h in hooks:
        h.remove()
    assert out.shape == (64, 10)
    assert [s[1] for s in shapes.values()] == [16, 32, 64]

    measured = pruning.compare({"original": model, "pruned": pruned}, x, repeats=9)
    print({k: {"params": v["params"], "MFLOPs": round(v["flops"] / 1e6, 1),
               "latency_ms": round(v["latency_s"] * 1e3, 3)} for k, v in measured.items()})
    assert measured["pruned"]["params"] == expected
    assert measured["pruned"]["flops"] < measured["original"]["flops"] / 3
    assert all(v["latency_s"] > 0 for v in measured.values())  # measured and compared, not asserted


def test_pruning_keeps_the_strongest_filters_and_nothing_else_changes_at_ratio_zero():
    torch.manual_seed(0)
    model = TinyCNN(10, width=8).eval()
    x = torch.randn(4, 3, 16, 16)
    same = pruning.prune_channels(model, 0.0).eval()
    with torch.no_grad():
        assert torch.equal(same(x), model(x))
    conv = model.features[0].conv
    pruned = pruning.prune_channels(model, 0.5)
    norms = conv.weight.abs().sum(dim=(1, 2, 3))
    kept = torch.sort(torch.topk(norms, 4).indices).values
    assert torch.equal(pruned.features[0].conv.weight, conv.weight[kept])
    assert torch.equal(pruned.features[1].conv.weight, model.features[1].conv.weight[:, kept][
        torch.sort(torch.topk(model.features[1].conv.weight.abs().sum(dim=(1, 2, 3)), 8).indices).values])


def test_residual_networks_and_bad_ratios_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="residual"):
        pruning.prune_channels(TinyResNet(10), 0.5)
    with pytest.raises(ValueError, match="merges branches"):
        pruning.prune_channels(TinyResNet(10, blocks=(2,)), 0.5)  # identity shortcuts only
    with pytest.raises(ValueError, match="0 <= ratio < 1"):
        pruning.prune_channels(TinyCNN(10), 1.0)


def test_a_model_on_a_gpu_is_pruned_there():
    # GPU_LAB_STRICT_DEVICE's stand-in device: a CPU index tensor beside the model's raised
    # "Expected all tensors to be on the same device" on a GPU (tutorial 12's vision case)
    from gpu_lab.rank import devicecheck

    devicecheck._copies_keep_their_device()  # as a strict rank has it: prune_channels deep-copies
    with devicecheck.mode():
        dev = devicecheck.device()
        torch.manual_seed(0)
        model = TinyCNN(10, width=16).to(dev).eval()
        # .to(dev) as the tutorial does: the stand-in device is a mark that weight.device misses
        pruned = pruning.prune_channels(model, 0.5).to(dev)
        with torch.no_grad():
            out = pruned(torch.randn(4, 3, 32, 32, device=dev))
        assert devicecheck.on_device(out) and out.shape == (4, 10)
        assert all(devicecheck.on_device(p) for p in pruned.parameters())
