"""Golden losses (``tools/golden_losses.py``): the three recorded configs rerun on the CPU give the recorded losses
and grad norms, and the GPU check's comparison passes within its tolerance and fails beyond it."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
from runs import overrides_of, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import golden_losses as golden  # noqa: E402

# where the torch build or the CPU's kernels differ from the recording's, fp32 arithmetic differs in its last bits
# (measured: AVX2 kernels against the recording's AVX512, up to 2e-7 relative over the 30 steps)
OTHER_CPU_RTOL = 1e-5


def test_comparison_passes_within_the_tolerance_and_fails_beyond_it():
    recorded = [7.0, 6.0, 5.0, 4.0]
    assert golden.compare(recorded, [7.01, 5.99, 5.02, 4.0])[0] == []
    problems, worst, mean = golden.compare(recorded, [7.0, 6.0, 5.0 + 1.1 * golden.MAX_ABS, 4.0])
    assert len(problems) == 1 and problems[0].startswith("step 3:") and worst == pytest.approx(1.1 * golden.MAX_ABS)
    near = 0.9 * golden.MAX_ABS  # every step within MAX_ABS, their mean beyond MEAN_ABS
    problems, _, mean = golden.compare(recorded, [x + near for x in recorded])
    assert problems == [f"mean |dloss| {mean:.4f} > {golden.MEAN_ABS}"]
    assert golden.compare(recorded, recorded[:3])[0] == ["3 steps measured, 4 recorded"]
    assert golden.compare(recorded, [7.0, math.nan, 5.0, 4.0])[0] == ["non-finite loss at step(s) 2"]
    line = golden.summary_line("dense", 4, *golden.compare(recorded, recorded))
    assert line == (f"golden dense: 4 steps, max |dloss| 0.0000 <= {golden.MAX_ABS}, mean |dloss| 0.0000 <= "
                    f"{golden.MEAN_ABS}, ok")


def test_check_refuses_without_a_gpu_in_one_line(capsys, tmp_path):
    """The suite hides the GPUs (conftest.py), as a machine without one has none: ``--check`` says so and exits 2."""
    assert golden.main(["--check", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--check needs a GPU" in err, err


def test_the_tools_overrides_alone_compose_the_tests_runs():
    """The recording's torchrun runs (the tool's overrides alone) and this module's forked runs (``runs.BASE``, then
    them) train one config."""
    from stem_megatron.recipes import compose_run

    paths = ["data.dir=/corpus", "out_dir=/out"]
    for name in golden.CONFIGS:
        for overrides in (golden.run_overrides(name, Path("/init")), golden.init_overrides(golden.CONFIGS[name][0])):
            alone = compose_run([*overrides, *paths])
            after_base = compose_run(overrides_of("/corpus", "/out", *overrides))
            assert dataclasses.asdict(alone) == dataclasses.asdict(after_base), name


@pytest.mark.slow
def test_cpu_losses_equal_the_recording(tmp_path):
    """Each config's loss and grad norm at every step, as floats from JSON: equal to the recording where torch and
    the CPU's kernels are the recording's, else within ``OTHER_CPU_RTOL``."""
    recording = json.loads(golden.RECORDING.read_text())
    corpus = golden.write_corpus(tmp_path)
    for init in golden.INITS:
        train(corpus, tmp_path / f"init_{init}", *golden.init_overrides(init))
    exact = {key: recording[key] for key in ("torch", "cpu_capability")} == {
        key: golden.versions()[key] for key in ("torch", "cpu_capability")}
    moved = []
    for name, (init, _) in golden.CONFIGS.items():
        run = train(corpus, tmp_path / name, *golden.run_overrides(name, tmp_path / f"init_{init}" / "checkpoints"))
        measured, recorded = golden.metrics(run.out_dir), recording["configs"][name]
        for key in ("loss", "grad_norm"):
            pairs = list(zip(recorded[key], measured[key]))
            steps = [s for s, (r, m) in enumerate(pairs, 1) if (r != m if exact else
                                                                 not math.isclose(r, m, rel_tol=OTHER_CPU_RTOL))]
            if steps or len(measured[key]) != len(recorded[key]):
                s = (steps or [len(pairs) + 1])[0]
                at = f"{pairs[s - 1][0]!r} recorded, {pairs[s - 1][1]!r} now" if steps else "a missing step"
                moved.append(f"{name} {key}: {len(steps)} of {len(recorded[key])} steps differ, first step {s}: {at}")
    how = "exactly" if exact else (f"within {OTHER_CPU_RTOL} (torch {recording['torch']} on "
                                   f"{recording['cpu_capability']} recorded, here another)")
    assert not moved, (f"the CPU losses left the recording ({how}): " + "; ".join(moved) + ". If the change means "
                       f"to move them, re-record with `{golden.RECORD_COMMAND}` and say why in the commit")
