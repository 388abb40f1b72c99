"""Estimators: physics invariants, the breakdown contract, history and the registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_colloc.estimators import (
    EstimatorInputError,
    SqliteHistory,
    estimate,
    estimator_names,
    parse_summary,
    read_summary_file,
)
from slurm_colloc.estimators.layer_aware import PRIOR, LayerAwareEstimator, load_calibration
from slurm_colloc.estimators.physics import SegmentPacker, round_request

DATA = Path(__file__).parent / "data" / "summaries"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def resnet50() -> str:
    return (DATA / "resnet50_torchinfo.txt").read_text()


def test_json_contract_fields(resnet50: str) -> None:
    e = estimate(resnet50, batch_size=32)
    d = e.to_json()
    assert isinstance(d["estimate_mib"], int) and d["estimate_mib"] > 0
    assert d["estimator"] == "layer-aware"
    assert isinstance(d["margin_mib"], int)
    assert isinstance(d["breakdown"], dict)
    assert d["fingerprint"] == parse_summary(resnet50).fingerprint()
    assert "uncertainty" in d


def test_breakdown_adds_up_and_includes_margin(resnet50: str) -> None:
    e = estimate(resnet50, batch_size=64)
    assert abs(sum(e.breakdown.values()) - e.estimate_mib) <= 1.0
    for key in ("cuda_context", "weights", "gradients", "optimizer_state", "activations",
                "workspace", "margin"):
        assert key in e.breakdown
    assert e.breakdown["margin"] == pytest.approx(e.margin_mib, abs=1)


@pytest.mark.parametrize("fname", sorted(p.name for p in DATA.iterdir() if p.is_file()))
def test_monotone_in_batch_and_optimizer(fname: str) -> None:
    s = read_summary_file(DATA / fname)
    sizes = [estimate(s, batch_size=b).estimate_mib for b in (1, 8, 64, 512)]
    assert sizes == sorted(sizes)
    opts = [estimate(s, batch_size=8, optimizer=o).estimate_mib
            for o in ("sgd", "momentum", "adam")]
    assert opts == sorted(opts)
    assert estimate(s, batch_size=8, optimizer="adamw").estimate_mib == opts[2]


def test_parameter_terms_are_exact(resnet50: str) -> None:
    s = parse_summary(resnet50)
    cal = load_calibration()
    e = estimate(s, batch_size=1)
    mib = s.total_params * 4 / 2**20
    assert e.breakdown["weights"] == pytest.approx(cal.k_params * mib)
    assert e.breakdown["optimizer_state"] == pytest.approx(cal.k_params * 3 * mib)  # m, v, step


def test_mixed_precision_shrinks_activations_not_weights(resnet50: str) -> None:
    fp32 = estimate(resnet50, batch_size=64)
    amp = estimate(resnet50, batch_size=64, precision="amp-bf16")
    assert amp.breakdown["activations"] < fp32.breakdown["activations"]
    assert amp.breakdown["weights"] > fp32.breakdown["weights"]  # the half copy
    assert any("mixed precision" in n for n in amp.notes)


def test_sequence_length_for_shapeless_summaries() -> None:
    text = (DATA / "bert_base_print.txt").read_text()
    short = estimate(text, batch_size=16, seq_len=128)
    long = estimate(text, batch_size=16, seq_len=512)
    assumed = estimate(text, batch_size=16)
    assert short.estimate_mib < long.estimate_mib
    assert assumed.estimate_mib == long.estimate_mib  # bounded by 512 position embeddings
    assert any("assumed 512" in n for n in assumed.notes)


def test_horus_formula_verbatim() -> None:
    text = (DATA / "mlp_colloc.json").read_text()
    s = parse_summary(text)
    acts = sum(la.out_elems(None) for la in s.leaves)
    b, p = 10, s.total_params
    expected = 4 * ((acts * b + p) + b * p) / 2**20
    e = estimate(s, batch_size=b, estimator="horus")
    assert e.estimate_mib == pytest.approx(expected, abs=1)


def test_prior_calibration_used_without_file(tmp_path: Path, resnet50: str) -> None:
    cal = load_calibration(tmp_path / "none.json")
    assert cal is PRIOR
    e = LayerAwareEstimator(cal).estimate(parse_summary(resnet50),
                                          __import__("slurm_colloc.estimators", fromlist=["Job"]).Job(batch_size=4))
    assert any("uncalibrated" in n for n in e.notes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch size"),
        ({"batch_size": 10**9}, "batch size"),
        ({"batch_size": 8, "optimizer": "lion"}, "optimizer"),
        ({"batch_size": 8, "precision": "fp8"}, "precision"),
        ({"batch_size": 8, "estimator": "magic"}, "unknown estimator"),
        ({"batch_size": 8, "seq_len": 0}, "sequence length"),
    ],
)
def test_bad_job_input(resnet50: str, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(EstimatorInputError, match=match):
        estimate(resnet50, **kwargs)  # type: ignore[arg-type]


def test_history_measurement_wins(tmp_path: Path, resnet50: str) -> None:
    store = SqliteHistory(tmp_path / "h" / "history.sqlite")
    fp = parse_summary(resnet50).fingerprint()
    assert store.lookup(fp, 32, None, "adam", "fp32") is None  # no db yet
    store.record(fp, 32, None, "adam", "fp32", 7000, job_id="1")
    store.record(fp, 32, None, "adam", "fp32", 6500, job_id="2")  # the larger peak is kept
    e = estimate(resnet50, batch_size=32, history=store)
    assert e.estimator == "history"
    assert e.estimate_mib == 7000 + e.margin_mib
    other = estimate(resnet50, batch_size=64, history=store)
    assert other.estimator == "history-anchored"  # one other batch size measured
    assert other.estimate_mib > e.estimate_mib
    cold = estimate(resnet50, batch_size=64)
    assert cold.estimator == "layer-aware"  # without history
    assert store.lookup(fp.upper(), 32, None, "adam", "fp32") == 7000  # case-insensitive


def test_registry_names() -> None:
    assert {"layer-aware", "horus", "tracing"} <= set(estimator_names())


def test_tracing_needs_a_factory(resnet50: str) -> None:
    with pytest.raises(EstimatorInputError, match="model-factory"):
        estimate(resnet50, batch_size=8, estimator="tracing")


def test_allocator_rounding() -> None:
    assert round_request(1) == 512
    assert round_request(11 * 2**20 + 1) == 12 * 2**20
    p = SegmentPacker()
    p.add(3 * 2**20, count=2)  # two mid-size blocks share one 20 MiB segment
    assert p.reserved() == 20 * 2**20


def test_default_path_imports_no_torch_or_pandas() -> None:
    code = ("import sys; from slurm_colloc.estimators import estimate; "
            f"estimate(open({str(DATA / 'resnet50_torchinfo.txt')!r}).read(), batch_size=8); "
            "bad = [m for m in ('torch', 'pandas', 'numpy') if m in sys.modules]; "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=REPO, env={"PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr


def test_tracing_estimator_with_torch(tmp_path: Path, resnet50: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Only where torch is installed (the optional ``torch`` extra)."""
    pytest.importorskip("torch")
    (tmp_path / "tiny_factory.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),\n"
        "                            torch.nn.Linear(256, 10))\n"
        "    return m, torch.randn(1, 64)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    e = estimate(resnet50, batch_size=8, estimator="tracing", model_factory="tiny_factory:make")
    assert e.estimator == "tracing"
    # 19,210 fp32 parameters: weights + gradients + Adam's two states + the foreach step
    # temporary = 5 x 76.8 kB, plus a few kB of activations. Counting MemTracker's
    # "Total" key as a category would double it.
    assert 0.30 < e.breakdown["traced_tensors"] < 0.45
    assert e.estimate_mib >= e.breakdown["cuda_context"]


def test_traced_peak_reads_the_total_not_the_sum() -> None:
    from slurm_colloc.estimators.tracing import traced_peak_bytes

    snap = {"cpu": {"Parameter": 100, "Gradient": 100, "Activation": 300, "Total": 500},
            "cuda:0": {"Parameter": 10, "Total": 10}}
    assert traced_peak_bytes(snap) == 500
    assert traced_peak_bytes({"cpu": {"Parameter": 7, "Activation": 5}}) == 12  # no total
    assert traced_peak_bytes({}) == 0


def test_margin_is_per_architecture_bucket(resnet50: str) -> None:
    """The margin comes from the job's bucket; an MLP summary gets the MLP margin, a
    CNN the CNN one, and the calibration file round-trips the per-bucket values."""
    import json

    from slurm_colloc.estimators.layer_aware import Calibration

    cal = load_calibration()
    assert {"cnn", "mlp"} <= set(cal.margin_rel_by_bucket)
    assert Calibration.from_dict(cal.to_dict()) == cal
    cnn = estimate(resnet50, batch_size=32)
    assert cnn.uncertainty["bucket"] == "cnn"
    mlp_doc = {"format": "colloc-summary/1", "layers": [
        {"type": "Linear", "output_shape": [4096], "params": 4096 * 1025},
        {"type": "ReLU", "output_shape": [4096], "params": 0},
        {"type": "Linear", "output_shape": [10], "params": 40970}]}
    mlp = estimate(json.dumps(mlp_doc), batch_size=256)
    assert mlp.uncertainty["bucket"] == "mlp"
    basis = mlp.breakdown["activations"] + mlp.breakdown["workspace"]
    assert mlp.breakdown["margin"] == pytest.approx(
        basis * cal.rel_margin("mlp") + cal.abs_margin("mlp"))
    assert cal.rel_margin("no-such-bucket") == cal.margin_rel == max(
        cal.margin_rel_by_bucket.values())


def test_blocks_hidden_by_torchinfo_depth_are_estimated_not_dropped() -> None:
    """torchinfo's default depth=3 shows each Hugging Face ViT layer as one row; the
    twelve layers' activations must still be counted (from their parameters), with
    the wider hidden-block margin and a note saying how to get a tighter estimate."""
    robust = DATA / "robustness"
    d3 = estimate((robust / "ti_vit_base_hf_default_depth.txt").read_text(), batch_size=64)
    d10 = estimate((robust / "ti_vit_base_hf_depth10.txt").read_text(), batch_size=64)
    assert d3.breakdown["activations"] >= 0.7 * d10.breakdown["activations"]
    assert d3.estimate_mib >= d10.estimate_mib
    assert any("depth=10" in n for n in d3.notes)
    assert not any("depth=10" in n for n in d10.notes)
