"""DeepSpeed on the CPU (gloo), as its users write the loop: ``deepspeed.initialize``, then
``engine.backward(loss)``, ``monitor.check(loss=loss)``, ``engine.step()``, at ZeRO stages 0-3 in
fp32 and bf16, on one process and on two. The runs are tests/deepspeed_cases.py (and its siblings, all
one launch a world size, their processes forked by tests/deepspeed_ranks.py, each running tests/deepspeed_many.py)
in processes of their own (DeepSpeed initialises torch.distributed); each case's premise is asserted before the
verdict: the healthy loss falls on a held-out batch, the planted bug is there (the engine's own
skipped-step count, masters that never move, a learning rate of 0, a frozen layer).
"""

from __future__ import annotations

import json
import math
import os
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from conftest import free_port
import procs

pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # (the `launches` fixture: three launches in one setup)

HERE = Path(__file__).parent
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"]
CONFIGS = [(s, p) for s in (0, 1, 2, 3) for p in ("fp32", "bf16")]
ONE = ([f"{s}-{p}-healthy" for s, p in CONFIGS] + ["1-bf16-frozen", "3-fp32-frozen", "1-fp32-lr0", "2-bf16-lr0", "3-bf16-lr0"]
       + ["0-fp32-inf", "0-bf16-inf", "1-bf16-inf", "2-fp32-inf", "3-bf16-inf", "2-bf16-engine", "fp16-unfused",
          "0-bf16-fused"])
TWO = ["2-bf16-healthy", "3-bf16-healthy", "1-fp32-frozen", "2-fp32-lr0", "3-bf16-inf"]
HF = ["trainer-2", "trainer-3", "accelerate-3", "accelerate-2-bug", "accelerate-2-gas"]
HF_NAMES = ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]


def _env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return env


def _outs(root: Path, scripts: dict[str, list[str]]) -> dict[str, Path]:
    return {name: root / f"{name}.json" for name in scripts}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The one-process cases of this file (deepspeed_cases.py's, then deepspeed_accum_cases.py's), then its
    two-rank cases (deepspeed_cases.py's, deepspeed_accum_cases.py's, deepspeed_window.py's): two launches, one
    after the other, each its own world, port and processes, forked as torchrun would start them from one process
    that imported DeepSpeed (tests/deepspeed_ranks.py; each rank runs tests/deepspeed_many.py, DeepSpeed imported
    once for all of them); then, where Transformers and Accelerate are installed, the HF stack's cases (the hf
    fixture's). Each launch's folder and scripts, and the launcher's output."""
    worlds = {1: (tmp_path_factory.mktemp("ds1"), {"deepspeed_cases": ONE,
                                                   "deepspeed_accum_cases": [*ACCUM, *ACCUM_BUGS, "experts-1"]}),
              2: (tmp_path_factory.mktemp("ds2"), {"deepspeed_cases": TWO, "deepspeed_accum_cases": ACCUM_TWO,
                                                   "deepspeed_window": WINDOW})}
    argv = []
    for ranks, (root, scripts) in worlds.items():
        outs = _outs(root, scripts)  # (a free port each: other DeepSpeed runs may share the machine)
        argv += ["+++", str(ranks), str(free_port()),
                 *[a for name, cases in scripts.items() for a in ("--", name, str(outs[name]), *cases)][1:]]
    if find_spec("transformers") and find_spec("accelerate"):  # (the HF stack's cases: the hf fixture's)
        worlds["hf"] = (tmp_path_factory.mktemp("dshf"), {})
        argv += ["+++", "hf", str(worlds["hf"][0]), *(f"{c}@{free_port()}" for c in HF)]
    proc = procs.run([sys.executable, str(HERE / "deepspeed_ranks.py"), *argv[1:]], env=_env(), capture_output=True,
                     text=True, timeout=900)
    return worlds, proc


def _results(launches, ranks: int) -> dict[str, list[dict]]:
    """One launch's results, each script's one dict a rank (its own failure if it failed: the other's stand)."""
    worlds, proc = launches
    root, scripts = worlds[ranks]
    outs = _outs(root, scripts)
    paths = {name: [out] + [Path(f"{out}.rank{r}") for r in range(1, ranks)] for name, out in outs.items()}
    assert all(p.exists() for ps in paths.values() for p in ps), proc.stdout[-6000:] + proc.stderr[-3000:]
    return {name: [json.loads(p.read_text()) for p in ps] for name, ps in paths.items()}


@pytest.fixture(scope="module")
def single(launches):
    return _results(launches, 1)


@pytest.fixture(scope="module")
def pair(launches):
    return _results(launches, 2)


@pytest.fixture(scope="module")
def one(single):
    return single["deepspeed_cases"][0]


@pytest.fixture(scope="module")
def two(pair):
    return pair["deepspeed_cases"]


@pytest.fixture(scope="module")
def hf(launches):
    """One process per case (Accelerate allows one DeepSpeed Accelerator a process), two at a time, each
    forked from the launches' process once it has imported Transformers and Accelerate too (tests/deepspeed_forks.py)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    worlds, proc = launches
    paths = [worlds["hf"][0] / f"{case}.json" for case in HF]
    assert all(p.exists() for p in paths), proc.stdout[-6000:] + proc.stderr[-3000:]
    return {k: v for p in paths for k, v in json.loads(p.read_text()).items()}


def _kinds(case: dict, kind: str) -> list[tuple]:
    return sorted({(k, level, step, msg) for k, level, step, msg in case["findings"] if k == kind}, key=lambda f: f[2])


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-12)


def _healthy(case: dict) -> None:
    assert case["error"] is None, case["error"]
    assert case["eval_after"] < 0.9 * case["eval_before"], (case["eval_before"], case["eval_after"])  # premise: it trains
    assert all(p == {} for p in case["problems"])
    assert not [f for f in case["findings"] if f[1] == "error"], case["findings"]
    assert case["names"] == NAMES
    for step, (total, oracle) in enumerate(zip(case["norms"], case["oracle"])):
        # the oracle: DeepSpeed's own accessor, parameter by parameter; and the engine's own norm (its clip's)
        assert _close(total, math.sqrt(sum(v * v for v in oracle))), (step, total, oracle)
        assert all(_close(case["grad_norms"][step][n], v) for n, v in zip(NAMES, oracle)), step
        if case["engine_norms"][step] is not None:
            assert _close(total, case["engine_norms"][step]), (step, total, case["engine_norms"][step])
    for step, (ours, truth) in enumerate(zip(case["updates"], case["true_updates"])):
        # the update of the fp32 masters DeepSpeed stepped, every step (update_every=1)
        assert sorted(ours) == sorted(NAMES), step
        assert all(_close(ours[n], t, 1e-4) for n, t in zip(NAMES, truth)), (step, ours, truth)


@pytest.mark.parametrize("stage,precision", CONFIGS, ids=[f"zero{s}-{p}" for s, p in CONFIGS])
def test_a_healthy_run_is_silent_under_raise_with_the_engines_norms(one, stage, precision):
    _healthy(one[f"{stage}-{precision}-healthy"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_parameters_partitioned_away_from_the_module_are_judged_whole(one, precision):
    case = one[f"3-{precision}-healthy"]
    assert all(case["empty_on_module"])  # premise: the module holds none of their elements
    assert not any(one[f"2-{precision}-healthy"]["empty_on_module"])  # (ZeRO-2 keeps them whole)
    assert case["status"] == dict.fromkeys(NAMES, "OK")
    assert all(v > 0 for v in case["grad_norms"][-1].values())


@pytest.mark.parametrize("case_id", ["1-bf16-frozen", "3-fp32-frozen"])
def test_a_frozen_layer_is_frozen_and_the_rest_train(one, case_id):
    case = one[case_id]
    assert case["status"]["fc1.weight"] == "FROZEN" and case["status"]["fc1.bias"] == "FROZEN"  # premise and verdict
    assert {n: s for n, s in case["status"].items() if not n.startswith("fc1.")} == dict.fromkeys(NAMES[2:], "OK")
    assert all(set(p) == set() for p in case["problems"])  # no NO_GRAD, no NOT_IN_OPTIMIZER for the others
    assert not [f for f in case["findings"] if f[1] == "error"]


@pytest.mark.parametrize("case_id", ["1-fp32-lr0", "2-bf16-lr0", "3-bf16-lr0"])
def test_a_learning_rate_of_zero_is_not_updated(one, case_id):
    case = one[case_id]
    assert case["moved"] is False and case["skipped_steps"] == 0  # premise: steps ran, the masters never moved
    found = [f for f in _kinds(case, "NOT_UPDATED") if f[1] == "error"]
    assert found and found[0][2] <= 2, case["findings"]
    assert "all 6 parameters" in found[0][3], found[0][3]  # every trained parameter, none left out


@pytest.mark.parametrize("case_id", ["0-bf16-inf", "1-bf16-inf", "2-fp32-inf", "3-bf16-inf"])
def test_steps_the_engine_skips_in_silence_are_named_at_once(one, case_id):
    case = one[case_id]
    # premise: a finite loss, every step skipped by DeepSpeed, the weights never moved
    assert all(math.isfinite(v) for v in case["losses"])
    assert case["skipped_steps"] == 8 and case["moved"] is False
    assert all(set(s.values()) == {"NON_FINITE_GRAD"} for s in case["problems"])
    skipped = _kinds(case, "OPTIMIZER_SKIPPED")
    assert [f[2] for f in skipped] == list(range(8)), skipped
    assert all(level == "error" for _, level, _, _ in skipped)
    first = skipped[0][3]
    assert "skipped the optimizer step after step 0" in first and "1 of its 1 steps" in first
    assert "weights have never changed" in first and "all 6 parameters" in first
    assert "8 of its 8 steps" in skipped[-1][3]


def test_a_stage_0_fp32_step_is_not_skipped_and_not_called_skipped(one):
    case = one["0-fp32-inf"]  # the control: torch's own AdamW steps into NaN, as it does without DeepSpeed
    assert case["skipped_steps"] == 0 and case["moved"] is True
    assert not _kinds(case, "OPTIMIZER_SKIPPED")
    assert set(case["problems"][0].values()) == {"NON_FINITE_GRAD"}


def test_bf16_without_zero_steps_flat_fp32_masters_and_they_are_what_is_judged(one):
    """DeepSpeed's fused FP16_Optimizer (bf16, ZeRO off, the config's Adam): its masters are one flat
    fp32 tensor per group. Premise: at lr 1e-4 some steps leave a bf16 weight as it was while its
    master moves. Verdict: silent under raise (before: 'left exactly unchanged by optimizer.step()',
    read from the bf16 weights), and every update norm is that of the master's slice."""
    case = one["0-bf16-fused"]
    assert (case["wrapper"], case["inner"]) == ("FP16_Optimizer", "FusedAdam") and case["error"] is None, case
    still_but_moved = [(s, k) for s, (still, moved) in enumerate(zip(case["weights_still"], case["masters_moved"]))
                       for k, (a, b) in enumerate(zip(still, moved)) if a and b]
    assert still_but_moved, "premise: a step moved a master but not its bf16 weight"
    assert not [f for f in case["findings"] if f[0] == "NOT_UPDATED"], case["findings"]
    for step, (ours, truth) in enumerate(zip(case["updates"], case["true_updates"])):
        assert all(_close(ours[n], t, 1e-4) for n, t in zip(case["order"], truth)), (step, ours, truth)


def test_a_monitor_on_the_engine_itself_names_the_models_parameters(one):
    case = one["2-bf16-engine"]
    assert case["names"] == NAMES  # not module.fc1.weight
    _healthy(case)


def test_two_ranks_reach_one_verdict_on_partitioned_gradients(two):
    r0, r1 = two
    for case_id in TWO:
        a, b = r0[case_id], r1[case_id]
        assert a["status"] == b["status"] and a["problems"] == b["problems"], case_id
        assert a["norms"] == b["norms"] or all(_close(x, y) for x, y in zip(a["norms"], b["norms"])), case_id
    for case_id in ("2-bf16-healthy", "3-bf16-healthy"):
        _healthy(r0[case_id])  # (the oracle and the engine's norm are the whole gradients': every shard counted once)
        _healthy(r1[case_id])
    frozen = r0["1-fp32-frozen"]["status"]
    assert frozen["fc1.weight"] == "FROZEN" and frozen["head.weight"] == "OK"
    for r in two:
        assert [f[2] for f in _kinds(r["2-fp32-lr0"], "NOT_UPDATED") if f[1] == "error"][:1] in ([1], [2])
        assert r["3-bf16-inf"]["skipped_steps"] == 8 and r["3-bf16-inf"]["moved"] is False
        assert [f[2] for f in _kinds(r["3-bf16-inf"], "OPTIMIZER_SKIPPED")] == list(range(8))


@pytest.mark.parametrize("case_id", ["trainer-2", "trainer-3", "accelerate-3", "accelerate-2-gas"])
def test_the_hf_trainer_and_accelerates_deepspeed_plugin_are_silent_and_exact(hf, case_id):
    # (accelerate-2-gas: the plugin's gradient_accumulation_steps=4; accelerator.backward steps the engine at its
    # boundaries only, the check after it: one report per window, its total the engine's norm of that window)
    case = hf[case_id]
    assert case["error"] is None, case["error"]
    assert case["eval_after"] < 0.8 * case["eval_before"], (case["eval_before"], case["eval_after"])  # premise: it trains
    assert case["names"] == HF_NAMES
    assert all(p == {} for p in case["problems"]) and not case["findings"], case["findings"][:3]
    # every check, and the norm DeepSpeed computed for its own clip of that step (Accelerate: the check comes
    # after accelerator.backward, which ran engine.step too: the norms were taken before that step freed them)
    assert len(case["norms"]) == len(case["engine_norms"]) == 12
    if case_id.endswith("-gas"):
        assert case["steps"] == list(range(12))  # (numbered by window: the checks between boundaries deferred)
    assert all(_close(a, b) for a, b in zip(case["norms"], case["engine_norms"])), (case["norms"], case["engine_norms"])


def test_accelerates_deepspeed_plugin_names_a_head_left_out_of_the_optimizer(hf):
    case = hf["accelerate-2-bug"]
    assert case["problems"][0] == {"body.2.weight": "NOT_IN_OPTIMIZER", "body.2.bias": "NOT_IN_OPTIMIZER"}
    assert case["steps"] == [0] and "NOT_IN_OPTIMIZER" in case["error"] and "body.2" in case["error"]


def test_a_dynamic_loss_scale_settling_is_info_and_the_norms_are_unscaled(one):
    case = one["fp16-unfused"]
    overflowed = [k for k, o in enumerate(case["overflow"]) if o]
    # premise: the first steps overflow at 2**24 and are skipped while DeepSpeed halves the scale, then it trains
    assert overflowed[:3] == [0, 1, 2] and len(overflowed) < 12
    assert case["losses"][-1] < case["losses"][0]
    assert case["error"] is None, case["error"]
    assert all(case["ok"])  # never an error: an fp16 scale settling (and overflowing now and then) is expected
    skipped = [f for f in case["findings"] if f[0] == "AMP_SKIPPED"]
    assert [f[2] for f in skipped] == overflowed and all(f[1] == "info" for f in skipped)
    assert not [f for f in case["findings"] if f[0] == "OPTIMIZER_SKIPPED"]
    for k in set(range(len(case["norms"]))) - set(overflowed):  # exact and unscaled (the gradients hold scale x g)
        assert case["problems"][k] == [] and _close(case["norms"][k], case["oracle"][k]), k


# ---------------------------------------------------------------- the engine's own accumulation
# (tests/deepspeed_accum_cases.py: "gradient_accumulation_steps": 4, engine.backward + engine.step on every micro-batch;
# monitor ``every`` checks after each engine.backward, ``boundary`` only where the engine says it is its boundary)
ACCUM = [f"{s}-{p}-{o}-healthy" for s in (1, 2, 3) for p in ("fp32", "bf16") for o in ("plain", "offload")]
ACCUM += ["0-fp32-plain-healthy", "0-bf16-plain-healthy"]  # (no ZeRO: the torch optimizer, DeepSpeed's bf16 one)
ACCUM_BUGS = ["1-bf16-offload-left", "2-fp32-plain-left", "3-bf16-offload-left",
              "1-fp32-plain-inf", "2-bf16-offload-inf", "3-fp32-offload-inf", "3-bf16-plain-inf"]
ACCUM_TWO = ["2-bf16-plain-healthy", "3-fp32-offload-healthy", "experts", "experts-z0"]
GAS, WINDOWS, INF_AT = 4, 6, 5


@pytest.fixture(scope="module")
def accum(single):
    return single["deepspeed_accum_cases"][0]


@pytest.fixture(scope="module")
def accum_two(pair):
    return pair["deepspeed_accum_cases"]


def _windows(case: dict) -> None:
    """Both loops: one report per window, at its boundary (the engine's), numbered by window; every
    check between boundaries deferred (None); the same reports whether checked after every
    micro-batch or at the boundary only."""
    assert case["boundaries"] == [GAS * w + GAS - 1 for w in range(WINDOWS)]  # premise: the engine's boundaries
    assert len(case["between"]) == (GAS - 1) * WINDOWS and all(case["between"])
    for loop in ("every", "boundary"):
        assert [r["step"] for r in case[loop]] == list(range(WINDOWS)), (loop, [r["step"] for r in case[loop]])
    assert [r["total"] for r in case["every"]] == [r["total"] for r in case["boundary"]]
    assert [r["problems"] for r in case["every"]] == [r["problems"] for r in case["boundary"]]


def _accum_healthy(case: dict) -> None:
    assert case["error"] is None, case["error"]
    assert case["eval_after"] < 0.8 * case["eval_before"], (case["eval_before"], case["eval_after"])  # premise: it trains
    assert case["skipped_steps"] == 0
    _windows(case)
    for loop in ("every", "boundary"):
        assert all(r["problems"] == {} and not r["findings"] for r in case[loop]), case[loop]
        for w, (r, engine, oracle) in enumerate(zip(case[loop], case["engine_norms"], case["oracle"])):
            # the whole window's gradients: the engine's own norm of the step (its clip's), and DeepSpeed's accessor
            assert engine is not None or case["case"].startswith("0-fp32"), w  # (stage 0 fp32 keeps none)
            assert engine is None or _close(r["total"], engine), (loop, w, r["total"], engine)
            assert _close(r["total"], math.sqrt(sum(v * v for v in oracle))), (loop, w, r["total"], oracle)
            assert all(_close(r["grad_norm"][n], v) for n, v in zip(NAMES, oracle)), (loop, w)


@pytest.mark.parametrize("case_id", ACCUM)
def test_the_engines_accumulation_is_judged_per_window_at_every_stage(accum, case_id):
    _accum_healthy(accum[case_id])


@pytest.mark.parametrize("case_id", ["1-bf16-offload-left", "2-fp32-plain-left", "3-bf16-offload-left"])
def test_a_layer_left_out_of_the_optimizer_is_named_under_the_engines_accumulation(accum, case_id):
    case = accum[case_id]
    _windows(case)
    assert case["eval_after"] < case["eval_before"]  # premise: the rest trains
    for loop in ("every", "boundary"):
        assert all(r["problems"] == {"head.weight": "NOT_IN_OPTIMIZER", "head.bias": "NOT_IN_OPTIMIZER"}
                   for r in case[loop]), case[loop]
        assert not [f for r in case[loop] for f in r["findings"] if f[0] in ("NOT_UPDATED", "TRANSIENT_GRAD")]


@pytest.mark.parametrize("case_id", ["1-fp32-plain-inf", "2-bf16-offload-inf", "3-fp32-offload-inf", "3-bf16-plain-inf"])
def test_an_inf_gradient_inside_a_window_is_named_at_its_boundary(accum, case_id):
    case = accum[case_id]
    _windows(case)
    assert case["skipped_steps"] == 1  # premise: the engine skipped the step of that window, and only it
    bad = INF_AT // GAS
    for loop in ("every", "boundary"):
        reports = case[loop]
        assert set(reports[bad]["problems"]) == set(NAMES)
        assert set(reports[bad]["problems"].values()) == {"NON_FINITE_GRAD"}
        assert all(r["problems"] == {} for k, r in enumerate(reports) if k != bad), loop
        kinds = {(f[0], f[2]) for r in reports for f in r["findings"] if f[1] == "error"}
        assert ("NONFINITE_ORIGIN", bad) in kinds and not [k for k in kinds if k[1] != bad], kinds
        skipped = [f for r in reports for f in r["findings"] if f[0] == "OPTIMIZER_SKIPPED"]
        assert skipped and all(f[2] == bad for f in skipped), skipped


def test_two_ranks_judge_the_engines_accumulation_per_window(accum_two):
    for r in accum_two:
        for case_id in ("2-bf16-plain-healthy", "3-fp32-offload-healthy"):
            _accum_healthy(r[case_id])  # (the oracle and the engine's norm: the whole gradients, every shard once)
    assert [x["total"] for x in accum_two[0]["2-bf16-plain-healthy"]["every"]] == \
        [x["total"] for x in accum_two[1]["2-bf16-plain-healthy"]["every"]]


def _one_dead_expert(ranks: list[dict], case_id: str) -> None:
    """Expert 3 gets no token (on two ranks: rank 1's local expert 1): named by its global index,
    each expert's norm its own, the same verdict on every rank."""
    unit = "moe.deepspeed_moe.experts.deepspeed_experts[{}]".format
    local_count = 4 // len(ranks)
    for rank, r in enumerate(ranks):
        case = r[case_id]
        assert case["rank"] == rank
        # premise: no rank's tokens go to expert 3; experts 0-2 get tokens at every step
        assert all(t[3] == 0 for t in case["tokens"])
        assert all(sum(x[e] for x in (a[case_id]["tokens"][k] for a in ranks)) > 0
                   for k in range(len(case["tokens"])) for e in range(3))
        # every expert is its own: the norms of this rank's local experts (DeepSpeed's accessor), at their global index
        for step, local in enumerate(case["local_norms"]):
            norms = case["expert_norms_by_step"][step]
            assert len(local) == local_count and len(norms) == 4
            for k, v in enumerate(local):
                assert _close(norms[unit(local_count * rank + k)], v), (rank, step, k, norms, local)
        assert case["expert_status"] == {unit(0): "OK", unit(1): "OK", unit(2): "OK", unit(3): "ZERO_GRAD"}
        dead = [f for f in case["findings"] if f[0] == "DEAD_EXPERT"]
        assert dead and all(unit(3) in f[3] and f[1] == "error" for f in dead), case["findings"]
        assert not [f for f in dead if any(unit(e) in f[3] for e in range(3))]
        assert not [f for f in case["findings"] if f[1] == "error" and f[0] != "DEAD_EXPERT"], case["findings"]
    assert len({json.dumps(r[case_id]["expert_status"], sort_keys=True) for r in ranks}) == 1  # one verdict


@pytest.mark.parametrize("case_id", ["experts", "experts-z0"], ids=["zero2", "zero0"])
def test_an_expert_that_gets_no_tokens_on_rank_1_is_named_by_its_global_index(accum_two, case_id):
    _one_dead_expert(accum_two, case_id)  # (ep_size=2: each rank's local experts 0 and 1 are experts 2r and 2r+1)
    # premise: rank 1's local experts are other experts than rank 0's (not replicas: no DESYNC, no GRAD_DISAGREE,
    # compared at every check; at ZeRO-0 their gradients are whole tensors on each rank, not ZeRO's fragments)
    assert all(a != b for a, b in zip(*(r[case_id]["first_weights"] for r in accum_two)))


def test_deepspeeds_experts_on_one_process_are_judged_per_expert(accum):
    _one_dead_expert([accum], "experts-1")


# ---------------------------------------------------------------- inside a window, on two ranks
# (tests/deepspeed_window.py: ZeRO-3, "gradient_accumulation_steps": 2, the check after every engine.backward;
# rank 1's first micro-batch of window 1 is the planted one)
WINDOW = ["healthy", "nan", "empty", "empty-tracked", "nan-boundary"]


@pytest.fixture(scope="module")
def window_two(pair):
    return pair["deepspeed_window"]


def _window_said(ranks: list[dict], case: str) -> dict:
    """The report of the planted window (window 1), the same on both ranks; the premise asserted."""
    for r in ranks:
        v = r[case]
        assert v["error"] is None and v["boundaries"] == [1, 3]  # the engine's boundaries
        assert v["returned"] == [False, True, False, True]  # the checks inside a window wait for its end
        planted = 3 if case == "nan-boundary" else 2  # (rank 1's micro-batch that is NaN, and nothing else)
        assert [math.isnan(x) for x in v["losses"]] == [v["rank"] == 1 and k == planted for k in range(4)]
        assert v["reports"][0]["findings"] == [] and v["reports"][0]["problems"] == []  # window 0 healthy
        assert v["reports"][1]["problems"] == ["NON_FINITE_GRAD"] and v["reports"][1]["n_problems"] == 6
    assert ranks[0][case]["reports"] == ranks[1][case]["reports"]
    return ranks[0][case]["reports"][1]


def test_zero3_windows_healthy_under_raise(window_two):
    for r in window_two:
        v = r["healthy"]
        assert v["error"] is None and v["eval_after"] < 0.85 * v["eval_before"]  # the premise: it trains
        assert v["returned"] == [False, True] * 4 and all(not x["findings"] and not x["problems"] for x in v["reports"])


@pytest.mark.parametrize("case", ["nan", "empty"])
def test_a_nan_loss_inside_a_zero3_window_is_named_with_its_rank_and_micro_batch(window_two, case):
    """Before: the window's report said NON_FINITE_GRAD and nothing else. Now it carries the NaN loss of
    rank 1's first micro-batch, checked (and deferred) there and read with the window's check."""
    said = _window_said(window_two, case)
    [f] = [f for f in said["findings"] if f[0] == "NON_FINITE_LOSS"]
    kind, level, message, ranks, micro = f
    assert level == "error" and ranks == [1] and micro == {"1": 0}
    assert "micro-batch 1 of 2 on rank 1" in message and "accumulation window that ends at step 1" in message


def test_an_empty_batch_inside_a_zero3_window_is_named_as_such_when_tracked(window_two):
    said = _window_said(window_two, "empty-tracked")
    [f] = [f for f in said["findings"] if f[0] == "EMPTY_VALID_SET"]
    kind, level, message, ranks, micro = f
    assert level == "error" and ranks == [1] and micro == {"1": 0} and "'tokens'" in message
    assert "NON_FINITE_LOSS" not in [x[0] for x in said["findings"]]  # (the NaN loss is the emptiness's)
    assert said["valid"] == {"tokens": 48}  # the window's count: 16 + 16 on rank 0, 0 + 16 on rank 1


def test_a_nan_loss_at_a_windows_end_is_named_with_its_rank(window_two):
    said = _window_said(window_two, "nan-boundary")
    [f] = [f for f in said["findings"] if f[0] == "NON_FINITE_LOSS"]
    assert f[1] == "error" and f[3] == [1] and f[4] is None and "on rank 1" in f[2]
