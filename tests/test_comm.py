"""Communication volume per optimizer step (recipes/testing/commstats.py, counted by the probe with --record_ranks and
CLS_COMM=1) against the textbook prediction (scripts/memory_model.py comm_bytes_per_step)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from helpers import PARITY_FLAGS, fp32_launch_args, no_gpu, rank_records, run_recipe
from recipes.testing import commstats
from recipes.testing.probe import COMM_STEPS, COMM_VARIABLE, Probe
from scripts import memory_model

COUNT = {COMM_VARIABLE: "1"}  # the launches below count their collectives (recipes/testing/probe.py)


@pytest.mark.parametrize("kind, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_gather", 2, 0.5), ("reduce_scatter", 4, 0.75),
    ("broadcast", 4, 0.75), ("reduce", 2, 0.5), ("all_to_all", 8, 0.875), ("gather", 2, 0.25), ("barrier", 8, 0.0),
    ("all_reduce", 1, 0.0)])
def test_ring_factors(kind, n, factor):
    assert commstats.ring_factor(kind, n) == pytest.approx(factor)


def test_counter_counts_host_reads_by_the_module_that_made_them():
    """`.item()`, `bool()` and `float()` of a tensor are host reads (a wait for the device on GPUs), counted by the
    module that asked, past the dispatch machinery; other ops are not."""
    t = torch.tensor([1.5, 2.0])
    with commstats.CommCounter() as counter:
        t.sum().item()
        bool((t > 1).all())
        float(t[0])
        t * 2
    assert dict(counter.host_reads) == {__name__: 3}


def test_n_reduces_of_a_slice_each_send_what_one_reduce_scatter_sends():
    """DeepSpeed ZeRO-2 reduces a bucket as one `reduce` per partition owner: the same bytes per rank."""
    n, size = 4, 4096
    reduces = n * (size / n) * commstats.ring_factor("reduce", n)
    assert reduces == pytest.approx(size * commstats.ring_factor("reduce_scatter", n))


@pytest.fixture(scope="module")
def fake_world():
    """Rank 0 of a world of 2 in this process: torch's fake process group, whose collectives are dispatched like
    gloo's and NCCL's (what the counter sees) and return without moving data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # Not a skip: the counting tests must run. A group left by another in-process test would be that test's leak.
    assert not dist.is_initialized(), "a process group is already initialized in this process (a test leaked it)"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield 2
    dist.destroy_process_group()


def counted(fn) -> commstats.CommCounter:
    counter = commstats.CommCounter()
    with counter:
        fn()
    return counter


def test_counter_reads_the_payload_of_each_collective(fake_world):
    x, whole, half = torch.ones(1000), torch.empty(2000), torch.empty(500)  # x: 4000 bytes
    c = counted(lambda: (dist.all_reduce(x), dist.broadcast(x, src=0), dist.all_gather_into_tensor(whole, x),
                         dist.reduce_scatter_tensor(half, x), dist.all_gather([x.clone(), x.clone()], x),
                         dist.reduce(x, dst=1), dist.all_reduce(torch.ones(10, dtype=torch.bfloat16)), dist.barrier()))
    assert dict(c.calls) == {"all_reduce": 2, "broadcast": 1, "all_gather": 2, "reduce_scatter": 1, "reduce": 1,
                             "barrier": 1}
    assert dict(c.payload_bytes) == {"all_reduce": 4020, "broadcast": 4000, "all_gather": 16000,
                                     "reduce_scatter": 4000, "reduce": 4000, "barrier": 0}
    assert dict(c.sent_bytes) == {"all_reduce": 4020, "broadcast": 2000, "all_gather": 8000,
                                  "reduce_scatter": 2000, "reduce": 2000, "barrier": 0}
    assert c.total() == 4020 + 2000 + 8000 + 2000 + 2000 and not c.unknown


def test_counter_sees_functional_and_coalesced_collectives_once(fake_world):
    from torch.distributed import _functional_collectives as funcol

    def run():
        funcol.all_reduce(torch.ones(256), "sum", dist.group.WORLD).wait()  # DTensor's path (the grad norm)
        dist.all_reduce_coalesced([torch.ones(3), torch.ones(5)])

    c = counted(run)
    assert dict(c.calls) == {"all_reduce": 2} and dict(c.payload_bytes) == {"all_reduce": 4 * 256 + 4 * 8}


def solo_gloo_group():
    """A real gloo group of one rank beside the fake world: DDP needs the values its all-reduces return."""
    from datetime import timedelta

    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                            dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60)))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def test_counter_sees_ddp_bucket_all_reduces_issued_from_cpp(fake_world, tiny_model):
    """DDP's reducer all-reduces from C++: the counter must see every gradient byte once per backward, and the
    buffers DDP broadcasts before each forward (payloads: one rank sends nothing)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=solo_gloo_group())
    x = torch.randint(5, 100, (2, 8))
    grads = sum(4 * p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())

    def step():
        ddp(input_ids=x, attention_mask=torch.ones_like(x)).logits.sum().backward()

    step()
    step()  # the second forward rebuilds the buckets
    c = counted(step)
    assert c.payload_bytes["all_reduce"] == grads and c.calls["all_reduce"] >= 1
    assert c.payload_bytes["broadcast"] == buffers > 0
    assert grads == 4 * memory_model.shape_from_model(str(tiny_model)).num_params
    # counting changes nothing: the same gradients, bit for bit, with the counter on and off
    ddp.eval()  # no dropout: the two passes compute the same
    for p in model.parameters():
        p.grad.zero_()
    counted(step)
    with_counter = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad.zero_()
    step()
    assert all(torch.equal(a, p.grad) for a, p in zip(with_counter, model.parameters()))


def test_counter_sees_fsdp2_gathers_and_reduce_scatters(fake_world):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    params = sum(4 * p.numel() for p in model.parameters())
    inner = sum(4 * p.numel() for p in model[0].parameters())
    fully_shard(model[0])
    fully_shard(model)

    def step():
        model(torch.randn(3, 16)).sum().backward()

    step()
    c = counted(step)
    assert c.payload_bytes["reduce_scatter"] == params  # every gradient once (16 x 32 + 32 + 32 x 4 + 4: no padding)
    # the root unit stays gathered from forward to backward; model[0] is gathered in forward and again in backward
    assert c.payload_bytes["all_gather"] == params + inner
    assert c.total() == (2 * params + inner) / 2 and not c.unknown
    # the gradient norm of DTensor shards: reduced inside DTensor's own dispatch, which the counter lets through
    norm = counted(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())
    assert norm.calls["all_reduce"] == 1 and 0 < norm.payload_bytes["all_reduce"] <= 4 * 4


class EngineLike(torch.nn.Module):
    """Like DeepSpeedEngine: train()/eval() switch the wrapped module only, the wrapper stays in training mode."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def forward(self, x):
        return self.module(x)


def test_probe_counts_only_the_chosen_steps_and_flags_evaluation(fake_world):
    model = EngineLike(torch.nn.Linear(4, 4))
    probe = Probe(record=True, rank=0, count_comm=True)
    probe.watch(model, SimpleNamespace(get_state_dict=lambda m: m.state_dict(), is_main_process=True))
    x = torch.ones(8, 4)
    for step in range(1, COMM_STEPS.stop + 1):
        probe.batch({"sample_ids": [step]})
        dist.all_reduce(x)
        if step == COMM_STEPS.start + 1:  # an evaluation after this step
            model.eval()
            model(x)
            dist.all_reduce(torch.ones(100))
            model.train()
        probe.step(step)
    record = probe.comm_record()
    assert list(record["steps"]) == [str(s) for s in COMM_STEPS]
    evaluated = [s for s, v in record["steps"].items() if v["evaluated"]]
    assert evaluated == [str(COMM_STEPS.start + 1)]
    assert all(v["collectives"]["all_reduce"]["payload_bytes"] == 128 for s, v in record["steps"].items()
               if s not in evaluated)


def tiny_shape(tiny_model):
    return memory_model.shape_from_model(str(tiny_model))


def test_prediction_on_the_tiny_model(tiny_model):
    shape = tiny_shape(tiny_model)
    P = shape.num_params
    predict = memory_model.comm_bytes_per_step
    assert predict("ddp", shape, 2, "fp32")["total"] == pytest.approx(2 * 4 * P / 2)
    assert predict("ddp", shape, 2, "bf16")["total"] == pytest.approx(4 * P)  # autocast: fp32 gradients
    assert predict("zero2", shape, 4, "fp32")["total"] == pytest.approx(2 * 4 * P * 3 / 4)
    assert predict("zero2_offload", shape, 2, "bf16")["total"] == pytest.approx(2 * 2 * P / 2)
    assert predict("zero3", shape, 2, "fp32")["total"] == pytest.approx(3 * 4 * P / 2)
    # FSDP2 gathers bf16 parameters and reduce-scatters fp32 gradients (workarounds/accelerate.py reduce_fsdp_gradients_in_fp32)
    assert predict("fsdp", shape, 8, "bf16")["terms"] == pytest.approx(
        {"all_gather": 2 * 2 * P * 7 / 8, "reduce_scatter": 4 * P * 7 / 8})
    assert predict("single", shape, 1, "fp32")["total"] == 0 == predict("ddp", shape, 1, "fp32")["total"]


def test_bench_reports_the_busiest_rank_beside_the_prediction_and_explains_departures(tiny_model):
    from scripts.measure import bench, bench_report

    shape = tiny_shape(tiny_model)
    P = shape.num_params
    step = {"sent_bytes": 6.0 * P, "evaluated": False, "unknown_ops": [],
            "collectives": {"all_reduce": {"calls": 2, "payload_bytes": 4 * P, "sent_bytes": 4.0 * P},
                            "all_gather": {"calls": 1, "payload_bytes": 4 * P, "sent_bytes": 2.0 * P}}}
    evaluated = dict(step, sent_bytes=99.0 * P, evaluated=True)
    records = [{"comm": {"steps": {"3": step, "4": step, "6": evaluated}, "comm_bytes_per_step": 6.0 * P}}] * 2
    run = bench.Run(model="tiny", name="zero2", kind="strategy", world=2, precision="fp32")
    bench.collect_comm(run, records, shape)
    assert run.comm_measured == 6 * P and run.comm_predicted == 4 * P and run.comm_ratio == pytest.approx(1.5)
    assert run.comm_breakdown == {"all_gather": [2 * P, 2 * P], "all_reduce": [4 * P, 0.0],
                                  "reduce_scatter": [0.0, 2 * P]}
    assert "  1.500" in bench.format_row(run, "peak RSS")
    lines = bench_report.comm_section({"runs": [bench.asdict(run)]})
    assert f"| tiny | zero2 | all_reduce | {4 * P / 2**20:.3f} | 0.000 |" in lines
    assert any(line.startswith("- tiny zero2: measured / textbook 1.500. DeepSpeed 0.19.8") for line in lines)
    single = bench.Run(model="tiny", name="single", kind="strategy", world=1)
    bench.collect_comm(single, [{"comm": {"steps": {"3": dict(step, sent_bytes=0.0, collectives={})},
                                          "comm_bytes_per_step": 0.0}}], shape)
    assert single.comm_measured == 0 and single.comm_predicted == 0 and single.comm_ratio is None


def test_counted_steps_end_before_the_bench_times_any():
    """The dispatch mode slows the steps it counts: they must all lie in every profile's warm-up."""
    from scripts.measure import bench

    assert COMM_STEPS.start >= 3  # after FSDP2's / DeepSpeed's first step and DDP's bucket rebuild at the second
    assert all(profile.warmup_steps >= COMM_STEPS.stop - 1 for profile in bench.PROFILES.values())


# ---- 2-process launches (fp32): measured against the prediction -----------------------------------------------------

def comm_of(output_dir) -> tuple[list, float]:
    """Bytes per clean counted step of every rank, and the mean of rank 0 (the probe's comm_bytes_per_step)."""
    records = rank_records(output_dir)
    per_rank = [[s["sent_bytes"] for s in r["comm"]["steps"].values() if not s["evaluated"]] for r in records]
    for r in records:
        assert all(not s["unknown_ops"] for s in r["comm"]["steps"].values())
    return per_rank, records[0]["comm"]["comm_bytes_per_step"]


def breakdown(output_dir) -> dict:
    """kind: bytes sent per step by rank 0, from its first clean counted step."""
    steps = rank_records(output_dir)[0]["comm"]["steps"].values()
    first = next(s for s in steps if not s["evaluated"])
    return {kind: v["sent_bytes"] for kind, v in first["collectives"].items()}


@pytest.mark.multiproc
@no_gpu
def test_ddp_sends_the_gradients_once(tiny_model, tmp_path):
    """DDP (8 steps, fp32, 2 processes): one ring all-reduce of every fp32 gradient, 2 x 4P x (n-1)/n, plus the
    buffers DDP broadcasts before each forward and the 20-byte reduction of the log (recipes/outputs/records.py
    StepLog)."""
    run_recipe(tmp_path, *PARITY_FLAGS, config="ddp.yaml", env=COUNT)
    per_rank, measured = comm_of(tmp_path)
    shape = tiny_shape(tiny_model)
    predicted = memory_model.comm_bytes_per_step("ddp", shape, 2, "fp32")["total"]
    print(f"ddp: measured {measured:,.0f} B/step/rank, predicted {predicted:,.0f}, ratio {measured / predicted:.4f}")
    assert len(per_rank[0]) == len(COMM_STEPS) and len({b for rank in per_rank for b in rank}) == 1
    kinds = breakdown(tmp_path)
    assert kinds["all_reduce"] == pytest.approx(predicted + 20)  # gradients + the log's 5 floats: loss sum, tokens,
    # padded tokens, and the two entries of the ranks' common decisions (non-finite gradient norms, stop votes)
    assert measured / predicted == pytest.approx(1.0, abs=0.01)


# (config, expected measured / textbook, why) for the tiny model on 2 processes, fp32
EXPECTED_RATIOS = {
    # DeepSpeed all-reduces whole gradient buckets (use_multi_rank_bucket_allreduce): 2 x psi/2 + all-gather psi/2,
    # against the textbook's psi/2 + psi/2
    "zero2.yaml": lambda shape: 1.5,
    # every parameter stays gathered from forward to backward (reuse distance 1e9): gathered once, not twice
    "zero3.yaml": lambda shape: 2 / 3,
    # FSDP2's root unit is gathered once (kept from forward to the end of backward), every other unit twice
    "fsdp.yaml": lambda shape: (3 * shape.num_params - shape.fsdp_root_params) / (3 * shape.num_params),
}


@pytest.mark.multiproc
@no_gpu
@pytest.mark.parametrize("config", sorted(EXPECTED_RATIOS))
def test_sharded_strategies_send_what_their_collectives_explain(tiny_model, tmp_path, config):
    run_recipe(tmp_path, "--max_train_steps", str(COMM_STEPS.stop - 1), "--per_device_train_batch_size", "4",
               "--record_ranks", config=config, launch_args=fp32_launch_args(config, tmp_path), env=COUNT)
    per_rank, measured = comm_of(tmp_path)
    shape = tiny_shape(tiny_model)
    predicted = memory_model.comm_bytes_per_step(config.removesuffix(".yaml"), shape, 2, "fp32")["total"]
    expected = EXPECTED_RATIOS[config](shape)
    print(f"{config}: measured {measured:,.0f} B/step/rank, predicted {predicted:,.0f}, ratio "
          f"{measured / predicted:.4f} (explained: {expected:.4f}); {json.dumps(breakdown(tmp_path))}")
    # the last step evaluates: the steps before it are counted, every one the same on every rank
    assert len(per_rank[0]) == len(COMM_STEPS) - 1 and len({b for rank in per_rank for b in rank}) == 1
    # what is left: padding of each partition to a multiple of the world size, grad-norm and log reductions
    assert measured / predicted == pytest.approx(expected, rel=0.01)
    if config == "zero3.yaml":
        # The gradients in one reduce-scatter per step: the tiny model's 1.5M parameters fit one bucket of the JSON's
        # 2e7 elements. Left at "auto" (hidden^2: 16,384 elements here) it took 30 (roberta-base shape: 148 -> 6;
        # scripts/measure/deepspeed_record.py records both).
        steps = [s for s in rank_records(tmp_path)[0]["comm"]["steps"].values() if not s["evaluated"]]
        assert [s["collectives"]["reduce_scatter"]["calls"] for s in steps] == [1] * len(steps)
