"""The user's accelerate config reaches real ranks launched from a real kernel: a script's bare
`Accelerator()` and a function's gpu_lab.accelerator() see the default file's bf16 on both
ranks, as under `accelerate launch`; config_file= names another file; launch()'s own
mixed_precision wins; the run's record says which file and what the ranks used."""
from __future__ import annotations

import json

import pytest
import yaml

pytestmark = pytest.mark.slow  # a real kernel launches ranks

SHOW = '''"""Each rank writes what its bare Accelerator() sees."""
import json, os, sys
from accelerate import Accelerator

acc = Accelerator()
with open(os.path.join(sys.argv[1], f"rank{acc.process_index}.json"), "w") as f:
    json.dump({"mixed_precision": acc.mixed_precision, "processes": acc.num_processes,
               "dynamo": os.environ.get("ACCELERATE_DYNAMO_BACKEND")}, f)
'''

FUNCTION = '''
def show(folder):
    import json, os
    import gpu_lab
    from accelerate import Accelerator
    mine, bare = gpu_lab.accelerator(), Accelerator()
    with open(os.path.join(folder, f"rank{mine.process_index}.json"), "w") as f:
        json.dump({"mixed_precision": mine.mixed_precision, "bare": bare.mixed_precision,
                   "processes": mine.num_processes}, f)
'''


def _config(path, precision: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
        "mixed_precision": precision, "num_processes": 2, "num_machines": 1, "machine_rank": 0,
        "gpu_ids": "all", "use_cpu": False, "debug": False,
        "dynamo_config": {"dynamo_backend": "NO"}}))


def _seen(folder) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_the_default_file_a_named_file_and_launchs_own_word(kernels, tmp_path):
    hf = tmp_path / "hf"
    _config(hf / "accelerate" / "default_config.yaml", "bf16")
    other = tmp_path / "other.yaml"
    _config(other, "no")
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    k = kernels(f"import os\nos.environ['HF_HOME'] = {str(hf)!r}\nimport gpu_lab\n{FUNCTION}")

    def launch(kind: str, tag: str, **kw) -> list[dict]:
        out = tmp_path / tag
        out.mkdir()
        target = f"{str(script)!r}, {str(out)!r}" if kind == "script" else f"show, {str(out)!r}"
        args = "".join(f", {k}={v!r}" for k, v in kw.items())
        got = k.json(f"run = gpu_lab.launch({target}, name={tag!r}{args})\n"
                     "print(json.dumps([run.wait(240), str(run.error), run.num_processes]))",
                     timeout=300)
        assert got == ["succeeded", "None", 2], got
        return _seen(out)

    # the default file, as `accelerate launch` reads it: both ranks, script and function
    assert [s["mixed_precision"] for s in launch("script", "script-default")] == ["bf16"] * 2
    seen = launch("function", "function-default")
    assert [(s["mixed_precision"], s["bare"]) for s in seen] == [("bf16", "bf16")] * 2
    # another file, named
    assert [s["mixed_precision"] for s in launch("script", "script-named",
                                                 config_file=str(other))] == ["no"] * 2
    # launch()'s own word wins over the file, as a flag wins in accelerate launch
    assert [s["mixed_precision"] for s in launch("function", "function-flag",
                                                 mixed_precision="no")] == ["no"] * 2
    # and no file at all
    assert [s["mixed_precision"] for s in launch("script", "script-none",
                                                 config_file=False)] == ["no"] * 2
    rows = k.json("print(json.dumps({r['name']: r['accelerate'] for r in "
                  "gpu_lab.Registry().list_runs()}))")
    assert rows["script-default"]["file"] == str(hf / "accelerate" / "default_config.yaml")
    assert rows["script-default"]["set"]["mixed_precision"] == "bf16"
    assert rows["script-named"]["file"] == str(other)
    assert rows["function-flag"]["mixed_precision"] == "no"
    # what the ranks said they use, beside what the file asked
    for name, want in (("script-default", "bf16"), ("function-default", "bf16"),
                       ("function-flag", "no"), ("script-none", "no")):
        said = {r: (u["mixed_precision"], u["distributed_type"], u["sharding"])
                for r, u in rows[name]["ranks"].items()}
        assert said == {"0": (want, "MULTI_CPU", "none"), "1": (want, "MULTI_CPU", "none")}, said
    assert "script-none" in rows and set(rows["script-none"]) == {"ranks"}  # no file
    table = k.run("print(gpu_lab.runs())")
    assert any("script-default" in line and " bf16 " in line for line in table.splitlines()), table


def test_a_train_config_at_its_default_takes_the_files_precision(kernels, tmp_path):
    hf = tmp_path / "hf"
    _config(hf / "accelerate" / "default_config.yaml", "bf16")
    k = kernels(f"import os\nos.environ['HF_HOME'] = {str(hf)!r}\nimport gpu_lab\n"
                "from gpu_lab.train import train_classifier")
    got = k.json(
        f"cfg = gpu_lab.TrainConfig(model='tiny_cnn', image_size=16, batch_size=8, max_steps=2, "
        f"eval_every=0, num_workers=0, tensorboard=False, output_dir={str(tmp_path / 'out')!r})\n"
        "a = gpu_lab.launch(train_classifier, cfg, name='cfg-default')\n"
        "b = gpu_lab.launch(train_classifier, cfg.replace(mixed_precision='bf16'), "
        "mixed_precision='no', name='launch-no')\n"
        "print(json.dumps([a.wait(240), a.result()['mixed_precision'], a.config.mixed_precision,"
        " b.wait(240), b.result()['mixed_precision']]))", timeout=560)
    assert got == ["succeeded", "bf16", "bf16", "succeeded", "no"], got
