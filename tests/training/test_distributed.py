"""Data-parallel training over several processes (torch.distributed, gloo over localhost; each
process a fresh interpreter with its own WebGPU device, here all on lavapipe) against one process.

Reference: the same Trainer in this (single) process with the global batch, i.e. batch 2b on one
rank for batch b on each of two ranks; also with the engine's gradients exchanged a layer at a
time, and for the command line under one torchrun and under two (two "nodes" meeting at a c10d
rendezvous on the loopback address). Every step must see the same examples, the same global
loss, token count and gradient norm, and end with the same adapters.

Tolerance: ``TOLERANCE`` = 1e-5 of each adapter tensor's largest magnitude after 4 steps, and
1e-5 relative on each step's loss and gradient norm. Both sides compute the same float32
products; only the order of the sums differs (one rank sums a step's gradient over 4 sequences
in its kernels; two ranks sum 2 sequences each and the all-reduce adds the two halves), so each
step's gradient differs by a few float32 roundings of the largest terms, ~1e-7 relative
(measured: ~1e-6 on the adapters after 4 steps). AdamW with ``eps`` = 1e-3, no larger than
the gradients, makes each update proportional to the gradient rather than its sign, so the
check sees gradient sizes too; a wrong global mean (a rank dividing by its own token count:
gradients x2), a wrong shard (other examples) or a missed all-reduce is off by far more
(percent level on loss, norm and adapters).

Workers start as fresh subprocesses (WebGPU cannot be used after fork once a device exists).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_wgpu_lora import Trainer
from torch_wgpu_lora.integrations.bitnet import add_lora_layers, load_bitnet, lora_parameters, lora_state_dict
from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet, build_tiny_tokenizer
from torch_wgpu_lora.prompts import format_prompt
from torch_wgpu_lora.runtime import get_device
from torch_wgpu_lora.runtime.device import ADAPTER_ENV
from torch_wgpu_lora.training.data import shard

from .helpers import EVAL_RECORDS, RECORDS

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
WORLD = 2
JOB_ENV = "TORCH_WGPU_LORA_TEST_JOB"

# One optimizer step covers 4 examples: 2 per rank on 2 ranks, 4 on 1 rank (8 records: 2 steps an epoch).
COMMON = dict(lr=5e-3, eps=1e-3, warmup_ratio=0.0, max_length=128, max_steps=4, progress=False, plot=False)
RUNS = {  # per-rank options; the one-process reference doubles the batch
    "engine": dict(COMMON, engine="wgpu", batch_size=2, max_grad_norm=0.0, save_every=2),
    "torch": dict(COMMON, engine="torch", batch_size=1, gradient_accumulation_steps=2, max_grad_norm=1.0),
}


# -- the worker (runs in each spawned process) --------------------------------------------------------

class Crash(RuntimeError):
    pass


def worker() -> None:
    """Run the job named by $TORCH_WGPU_LORA_TEST_JOB as this rank; write result-RANK.json."""
    job = json.loads(Path(os.environ[JOB_ENV]).read_text())
    rank = int(os.environ["RANK"])
    from transformers import AutoTokenizer

    from torch_wgpu_lora.runtime import device_info
    from torch_wgpu_lora.training.distributed import init_from_env

    assert init_from_env(job["timeout"])
    info = device_info()
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    results = {"device": {k: info[k] for k in ("local_rank", "adapter_index", "adapters_of_kind", "choice")}}
    for run in job["runs"]:
        results[run["name"]] = _run(run, rank, tokenizer, Path(job["folder"]), job["model"])
    torch.distributed.destroy_process_group()
    results["gloo_threads_left"] = _gloo_threads()
    (Path(job["folder"]) / f"result-{rank}.json").write_text(json.dumps(results))


def _gloo_threads() -> int:
    """This process's threads named by gloo (Linux names each in /proc)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(comm.read_text())
        except OSError:  # a thread that ended meanwhile
            pass
    return sum("gloo" in name for name in names)


def _run(run: dict, rank: int, tokenizer, folder: Path, model_path: str) -> dict:
    from safetensors.torch import save_file

    model = add_lora_layers(load_bitnet(model_path), r=4, lora_alpha=8)
    params = lora_parameters(model)
    if rank != 0:  # another start on rank 1: the trainer must start every rank from rank 0's adapters
        with torch.no_grad():
            for p in params:
                p.add_(0.5)
    seen = {}

    def callback(record):
        if "loss" not in record:
            return
        step = record["step"]
        seen[step] = time.time()
        if step == run.get("crash_at"):  # every rank stops here, as a crashed job would
            raise Crash(f"crash at step {step}")
        if step == run.get("kill_at") and rank == 1:
            os._exit(3)  # dies without a word: its sockets close
        if step == run.get("hang_at") and rank == 1:
            time.sleep(run["hang_for"])  # alive, but answers nothing: only the timeout can tell
        if step == run.get("perturb_at") and rank == 1:
            with torch.no_grad():
                params[0][0, 0] += 1e-3

    options = dict(run["options"], **run.get(f"rank{rank}", {}), output_dir=folder / f"{run['output']}-rank{rank}",
                   callback=callback)
    from torch_wgpu_lora.training import distributed

    cpu_backend = distributed._cpu_backend
    if run.get("beside"):  # as under an NCCL default group: the collectives go through a gloo group beside it
        distributed._cpu_backend = lambda backend: False
    try:
        trainer = Trainer(model, tokenizer, RECORDS, eval_data=EVAL_RECORDS if run.get("eval") else None, **options)
        result = trainer.train(resume_from=run.get("resume"))
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err), "at": time.time(), "seen": seen}
    finally:
        distributed._cpu_backend = cpu_backend
    save_file({k: v.contiguous() for k, v in lora_state_dict(model).items()},
              str(folder / f"{run['name']}-rank{rank}.safetensors"))
    events = [] if trainer.engine is None else trainer.engine.optimizer_step.exchange_events
    return {"steps": result.steps, "loss": result.loss, "eval_loss": result.eval_loss,
            "own_group": trainer.dist.group is not None,
            "buckets": sum(what == "reduce" for what, _, _ in events)}  # of the last step


# -- launching ----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_env() -> dict[str, str]:
    """What every rank's environment adds: nothing where this machine has an adapter of the preferred
    kind for each rank, or a CPU adapter (which the ranks share); on a machine with fewer GPUs than
    ranks, the first of them named in ADAPTER_ENV, so that the ranks share it by hand."""
    device = get_device()
    if device.choice.of_kind >= WORLD or device.is_cpu:
        return {}
    return {ADAPTER_ENV: device.info["device"]}


def launch(folder: Path, job: dict, timeout: float = 150) -> tuple[list[dict | None], list[int], list[str]]:
    """Start WORLD fresh processes running ``worker`` (ranks 0..WORLD-1, gloo over localhost); returns
    each rank's results (None if it wrote none), exit status and stderr."""
    spec = folder / "job.json"
    spec.write_text(json.dumps({**job, "folder": str(folder)}))
    port = _free_port()
    shared = ranks_env()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD), JOB_ENV: str(spec),
               "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",  # 2 processes share 2 cores with lavapipe
               "PYTHONFAULTHANDLER": "1", **shared}  # a crash in native code shows its Python stack
        with open(folder / f"stderr-{rank}.txt", "w") as log:  # a file, not a pipe: a full pipe would block
            procs.append(subprocess.Popen([sys.executable, "-c", "from tests.training.test_distributed import worker; worker()"],
                                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errors = [_failure_report(folder, rank, p.returncode) for rank, p in enumerate(procs)]
    results = []
    for rank in range(WORLD):
        path = folder / f"result-{rank}.json"
        results.append(json.loads(path.read_text()) if path.is_file() else None)
    return results, [p.returncode for p in procs], errors


def _failure_report(folder: Path, rank: int, status: int) -> str:
    """A rank's exit status, whether it wrote its results, and its stderr (without transformers'
    progress bars; a native crash's Python stacks first, where CPython's fault handler printed them)."""
    wrote = (folder / f"result-{rank}.json").is_file()
    lines = [line for line in (folder / f"stderr-{rank}.txt").read_text(errors="replace").splitlines()
             if line.strip() and "Loading weights" not in line and not line.startswith("Extension modules:")]
    text = "\n".join(lines)
    fault = text.find("Fatal Python error")
    stderr = text[max(0, fault - 300):fault + 2500] if fault >= 0 else text[-2500:]  # with the line before
    return f"rank {rank}: exit status {status}, {'wrote' if wrote else 'did not write'} its results; stderr:\n{stderr}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny")
    texts = [format_prompt(r["instruction"], r.get("input", "")) + r["output"] for r in RECORDS + EVAL_RECORDS]
    model = build_tiny_bitnet(root / "model", flavour="dense")
    build_tiny_tokenizer(model, texts)  # in the model folder, as the CLI loads it
    return {"model": str(model), "tokenizer": str(model), "loaded": AutoTokenizer.from_pretrained(model)}


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory):
    """One launch of two ranks, several runs in a row (process start-up is most of the cost)."""
    folder = tmp_path_factory.mktemp("two-ranks")
    engine = RUNS["engine"]
    # A one-process run's checkpoint, which two ranks must refuse to resume (rank 0 reads "NAME-rank0").
    model = add_lora_layers(load_bitnet(tiny["model"]), r=4, lora_alpha=8)
    Trainer(model, tiny["loaded"], RECORDS, **dict(engine, output_dir=folder / "single-rank0")).train()
    runs = [
        {"name": "engine", "output": "engine", "options": engine, "eval": True},
        {"name": "torch", "output": "torch", "options": RUNS["torch"]},
        {"name": "interrupted", "output": "resume", "options": engine, "crash_at": 3},
        {"name": "resumed", "output": "resume", "options": engine, "resume": True},
        {"name": "diverged", "output": "diverged", "options": dict(engine, check_every=1), "perturb_at": 1},
        {"name": "disagree", "output": "disagree", "options": engine, "rank1": {"lr": 1e-3}},
        {"name": "buckets", "output": "buckets", "options": dict(engine, ddp_bucket_cap_mb=1e-6)},  # a layer each
        {"name": "bucket_sizes", "output": "bucket-sizes", "options": engine, "rank1": {"ddp_bucket_cap_mb": 0.5}},
        {"name": "refused", "output": "engine", "options": engine},  # a fresh run over rank 0's earlier one
        {"name": "from_one", "output": "single", "options": engine, "resume": True},
        {"name": "beside", "output": "beside", "options": engine, "eval": True, "beside": True},
    ]
    results, status, errors = launch(folder, {"model": tiny["model"], "tokenizer": tiny["tokenizer"],
                                              "timeout": 60, "runs": runs})
    assert status == [0] * WORLD, errors
    return folder, results


def reference(tiny, tmp_path, name, **overrides):
    """The same run in this one process with the global batch: (adapter, metrics records)."""
    options = dict(RUNS[name], output_dir=tmp_path / name, **overrides)
    options["batch_size"] *= WORLD  # the same accumulation, micro-batches WORLD times larger
    model = add_lora_layers(load_bitnet(tiny["model"]), r=4, lora_alpha=8)
    result = Trainer(model, tiny["loaded"], RECORDS, eval_data=EVAL_RECORDS if name == "engine" else None,
                     **options).train()
    return lora_state_dict(model), read_metrics(tmp_path / name), result


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def load(folder: Path, name: str, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / f"{name}-rank{rank}.safetensors"))


def assert_close_adapters(ours, theirs):
    assert ours.keys() == theirs.keys()
    for key in ours:
        scale = theirs[key].abs().max()
        assert scale > 0, key
        assert (ours[key] - theirs[key]).abs().max() <= TOLERANCE * scale, key


def assert_same_steps(ours: list[dict], theirs: list[dict]):
    """Same steps, same tokens (exact: the same examples), loss and norm within rounding."""
    ours = [r for r in ours if "loss" in r]
    theirs = [r for r in theirs if "loss" in r]
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4]
    for a, b in zip(ours, theirs):
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"]


# -- the tests ----------------------------------------------------------------------------------------

def test_shards_are_dealt_as_distributed_sampler_deals_them():
    from torch.utils.data import DistributedSampler

    for n in (1, 5, 8, 11):
        order = np.random.default_rng(n).permutation(n)
        for world in (1, 2, 3, 4):
            shards = [shard(order, rank, world) for rank in range(world)]
            for rank, mine in enumerate(shards):
                expected = [int(order[i]) for i in DistributedSampler(range(n), num_replicas=world, rank=rank,
                                                                       shuffle=False)]
                assert mine.tolist() == expected
            # the first k of every shard are the first world·k of the order
            k = len(shards[0])
            assert sorted(sum((s[:k].tolist() for s in shards), [])) == sorted(np.resize(order, world * k).tolist())


def test_what_ranks_send_each_other_is_parsed_never_unpickled():
    import pickle

    from torch_wgpu_lora.training.checkpoint import DamagedCheckpoint, rng_state
    from torch_wgpu_lora.training.distributed import _loaded_exception, _type_name, decode, encode

    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([w])
    w.grad = torch.ones(3, 2)
    opt.step()
    value = {"optimizer": opt.state_dict(), "rngs": [rng_state()], "folder": Path("/run/x"),
             "mixed": (1, 2.5, None, True, "s", [3, {"k": torch.arange(4)}])}
    data = encode(value)
    assert data[8:9] == b"{"  # a safetensors blob: its JSON header follows the 8-byte size
    got = decode(data)
    state, again = opt.state_dict(), got["optimizer"]
    assert again["param_groups"] == state["param_groups"] and list(again["state"]) == [0]  # int keys stay ints
    for name in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(again["state"][0][name], state["state"][0][name])
    assert got["folder"] == Path("/run/x") and got["mixed"][:5] == (1, 2.5, None, True, "s")
    assert torch.equal(got["mixed"][5][1]["k"], torch.arange(4))
    assert torch.equal(got["rngs"][0]["torch"], value["rngs"][0]["torch"])
    with pytest.raises(TypeError, match="cannot send a Linear between ranks"):
        encode({"model": torch.nn.Linear(2, 2)})
    with pytest.raises(Exception):  # bytes of a pickle are not a payload
        decode(pickle.dumps(value))
    assert _loaded_exception(_type_name(DamagedCheckpoint)) is DamagedCheckpoint
    assert _loaded_exception("os.system") is None


@pytest.mark.parametrize("path", ["engine", "torch"])
def test_two_ranks_train_the_adapters_one_rank_trains_with_the_global_batch(tiny, two_ranks, tmp_path, path):
    folder, results = two_ranks
    adapter, metrics, result = reference(tiny, tmp_path, path)
    ours = load(folder, path, 0)
    assert_close_adapters(ours, adapter)
    for key, value in load(folder, path, 1).items():  # both ranks hold the very same adapters
        assert torch.equal(value, ours[key]), key
    assert_same_steps(read_metrics(folder / f"{path}-rank0"), metrics)
    assert results[0][path]["loss"] == results[1][path]["loss"]  # the logged loss is the global one
    assert abs(results[0][path]["loss"] - result.loss) <= 1e-5 * result.loss
    if path == "engine":  # evaluation: each rank evaluates its share, the loss is over all of them
        assert abs(results[1][path]["eval_loss"] - result.eval_loss) <= 1e-5 * result.eval_loss
    # rank 0 alone writes: rank 1's output folder stays empty
    assert (folder / f"{path}-rank0" / "adapter").is_dir() and (folder / f"{path}-rank0" / "metrics.jsonl").is_file()
    assert not (folder / f"{path}-rank1").exists() or not any((folder / f"{path}-rank1").iterdir())


def test_destroy_process_group_ends_the_gloo_threads_before_the_interpreter_shuts_down(two_ranks):
    # Left running (a process group kept alive after destroy_process_group), they free finished
    # collectives during interpreter shutdown, which aborts the process now and then.
    _, results = two_ranks
    assert [r["gloo_threads_left"] for r in results] == [0] * WORLD


def test_each_rank_took_its_own_adapter_or_shared_the_cpu_one(two_ranks):
    _, results = two_ranks
    for rank, result in enumerate(results):
        device = result["device"]
        assert device["local_rank"] == rank
        if ranks_env():  # fewer GPUs than ranks: the first, named by hand for both
            assert device["adapter_index"] == 0 and ADAPTER_ENV in device["choice"]
        elif device["adapters_of_kind"] > rank:
            assert device["adapter_index"] == rank
        else:  # lavapipe: one CPU adapter, which both share
            assert device["adapter_index"] == 0 and "share" in device["choice"]


def test_a_two_rank_checkpoint_resumes_bit_identically_and_only_with_two_ranks(tiny, two_ranks, tmp_path):
    folder, results = two_ranks
    assert [r["interrupted"]["error"] for r in results] == ["Crash", "Crash"]
    for rank in range(WORLD):  # steps 1-2, checkpoint, crash in step 3; then steps 3-4 from the checkpoint
        assert results[rank]["resumed"]["steps"] == 4
        straight, resumed = load(folder, "engine", rank), load(folder, "resumed", rank)
        for key in straight:
            assert torch.equal(resumed[key], straight[key]), key
    logs = [read_metrics(folder / f"{name}-rank0") for name in ("engine", "resume")]
    assert [r["loss"] for r in logs[1] if "loss" in r] == [r["loss"] for r in logs[0] if "loss" in r]
    state = json.loads((folder / "resume-rank0" / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["trainer"]["settings"]["world_size"] == 2 and len(state["rng"]["ranks"]) == 1

    # One process cannot continue a two-process run: refused, saying why and how.
    options = dict(RUNS["engine"], output_dir=folder / "resume-rank0")
    model = add_lora_layers(load_bitnet(tiny["model"]), r=4, lora_alpha=8)
    trainer = Trainer(model, tiny["loaded"], RECORDS, **options)
    with pytest.raises(ValueError, match=r"written by a run of 2 processes \(world size 2\); this run has 1\. "
                                         r"Resume it with 2 processes \(e\.g\. torchrun --nproc-per-node 2"):
        trainer.train(resume_from=True)


def test_gradients_exchanged_a_layer_at_a_time_train_the_adapters_one_rank_trains_with_the_global_batch(
        tiny, two_ranks, tmp_path):
    # A bucket per layer (the tiny model has two): each all-reduced while the backward runs on.
    folder, results = two_ranks
    assert [r["buckets"]["buckets"] for r in results] == [2, 2]
    assert [r["engine"]["buckets"] for r in results] == [1, 1]  # the default size holds the tiny model's whole
    adapter, metrics, result = reference(tiny, tmp_path, "engine")
    ours = load(folder, "buckets", 0)
    assert_close_adapters(ours, adapter)
    for key, value in load(folder, "buckets", 1).items():
        assert torch.equal(value, ours[key]), key
    assert_same_steps(read_metrics(folder / "buckets-rank0"), metrics)
    assert abs(results[0]["buckets"]["loss"] - result.loss) <= 1e-5 * result.loss


def test_a_gloo_group_beside_a_default_group_that_takes_no_cpu_tensors_trains_the_same(two_ranks):
    # What runs under an NCCL default group (CPU builds have none, so the test forces that branch):
    # the same collectives over a gloo group of its own, the same steps, the same adapters.
    folder, results = two_ranks
    for rank, result in enumerate(results):
        assert result["beside"]["own_group"] and not result["engine"]["own_group"], rank
        assert result["beside"]["loss"] == result["engine"]["loss"], rank
        straight, beside = load(folder, "engine", rank), load(folder, "beside", rank)
        assert all(torch.equal(beside[key], straight[key]) for key in straight), rank


def test_a_one_process_checkpoint_is_refused_by_two_ranks_saying_how_to_resume_it(two_ranks):
    _, results = two_ranks
    for rank, result in enumerate(results):  # rank 0 read it; rank 1 heard its error
        refused = result["from_one"]
        assert refused["error"] == "ValueError", rank
        assert ("written by a run of 1 process (world size 1); this run has 2. Resume it in one process "
                "(without torchrun)") in refused["message"], rank


def test_diverged_adapters_stop_every_rank_naming_the_rank(two_ranks):
    _, results = two_ranks
    for result in results:
        diverged = result["diverged"]
        assert diverged["error"] == "RanksDiverged"
        assert "after step 1 the adapters of rank 1 differ from rank 0's" in diverged["message"]


@pytest.mark.parametrize("run, differ", [
    ("disagree", "lr: rank 0 0.005, rank 1 0.001"),
    ("bucket_sizes", "ddp_bucket_cap_mb: rank 0 1.0, rank 1 0.5"),  # each bucket's all-reduce would pair other sizes
])
def test_ranks_given_other_settings_are_refused_before_training(two_ranks, run, differ):
    _, results = two_ranks
    for result in results:
        assert result[run]["error"] == "DistributedError"
        assert f"the processes were given different training settings ({differ})" in result[run]["message"]


def test_rank_0_decides_about_the_output_folder_for_every_rank(two_ranks):
    # Only rank 0's folder holds the earlier run; rank 1 gets rank 0's refusal, word for word.
    _, results = two_ranks
    refused = [result["refused"] for result in results]
    assert [r["error"] for r in refused] == ["ValueError", "ValueError"]
    assert refused[0]["message"] == refused[1]["message"]
    assert "engine-rank0 already holds checkpoints (newest: step-000004) of an earlier run" in refused[1]["message"]


def test_backends_that_take_cpu_tensors_are_used_as_they_are():
    from torch_wgpu_lora.training.distributed import _cpu_backend

    assert _cpu_backend("gloo") and _cpu_backend("mpi") and _cpu_backend("cpu:gloo,cuda:nccl")
    assert not _cpu_backend("nccl") and not _cpu_backend("cuda:nccl")


@pytest.mark.parametrize("failure", ["killed", "hung"])
def test_a_killed_or_hung_rank_ends_the_other_with_a_clear_error_within_the_timeout(tiny, tmp_path, failure):
    timeout = 20 if failure == "killed" else 8
    run = {"name": failure, "output": failure, "options": dict(RUNS["engine"], max_steps=6),
           f"{'kill' if failure == 'killed' else 'hang'}_at": 3, "hang_for": timeout + 4}
    results, status, errors = launch(tmp_path, {"model": tiny["model"], "tokenizer": tiny["tokenizer"],
                                                "timeout": timeout, "runs": [run]}, timeout=120)
    assert status[0] == 0, errors[0]
    stopped = results[0][failure]
    assert stopped["error"] == "RankLost"
    assert ("failed on rank 0 of 2: another process of the run died or did not answer within the timeout of "
            f"{timeout} s") in stopped["message"]
    assert "the newest checkpoint is" in stopped["message"] and "step-000002" in stopped["message"]  # where to resume
    waited = stopped["at"] - stopped["seen"]["3"]  # from rank 0's step 3 to its error
    if failure == "killed":  # rank 1 died in step 3's callback: its closed sockets end the wait at once
        assert status[1] == 3 and results[1] is None
        assert waited <= timeout
    else:  # rank 1 slept through the timeout: rank 0 gave up after it, not before, and not much later:
        # its step 4's own work comes first, as long as a step takes on this machine (its step 3's time)
        step = stopped["seen"]["3"] - stopped["seen"]["2"]
        assert timeout - 1 <= waited <= timeout + 10 + 2 * step, (waited, step)
        assert status[1] == 0 and results[1][failure]["error"] == "RankLost"  # rank 1 woke to a dead run


@pytest.fixture(scope="module")
def command_line(tiny, tmp_path_factory):
    """The command line's training options (a data file of RECORDS), and their run in this one process
    with the global batch (4 examples a step): its metrics records."""
    folder = tmp_path_factory.mktemp("command-line")
    data = folder / "data.json"
    data.write_text(json.dumps(RECORDS))
    args = ["train", "--model", tiny["model"], "--data", str(data), "--max-steps", "2", "--no-progress",
            "--lr", "5e-3", "--dist-timeout", "60"]
    from torch_wgpu_lora.cli import main

    assert main([*args, "--output", str(folder / "one"), "--batch-size", "4"]) == 0
    return args, read_metrics(folder / "one")


def assert_same_command_line_steps(ours: list[dict], theirs: list[dict]):
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"]


def test_torchrun_runs_the_command_line_on_two_processes(command_line, tmp_path):
    args, one = command_line
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", **ranks_env()}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "torch_wgpu_lora", *args, "--output", str(tmp_path / "two"), "--batch-size", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("trained 2 steps") == 1  # rank 0 alone prints
    assert_same_command_line_steps(read_metrics(tmp_path / "two"), one)


def test_torchrun_on_two_nodes_meeting_at_a_c10d_rendezvous_trains_as_one_process(command_line, tmp_path):
    # Two machines as one machine can stand for them: two torchrun launches of one process each
    # (each its node's LOCAL_RANK 0, as on separate machines), meeting at the c10d rendezvous on
    # the loopback address, the gradients exchanged a layer at a time.
    args, one = command_line
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", **ranks_env()}
    nodes = []
    for node in range(2):
        with open(tmp_path / f"node{node}.txt", "w") as log:  # files, not pipes: a full pipe would block
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
                 "-m", "torch_wgpu_lora", *args, "--output", str(tmp_path / "two"), "--batch-size", "2",
                 "--ddp-bucket-cap-mb", "1e-6"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        status = [p.wait(timeout=180) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(tmp_path / f"node{node}.txt").read_text(errors="replace") for node in range(2)]
    assert status == [0, 0], [log[-3000:] for log in logs]
    assert sum(log.count("trained 2 steps") for log in logs) == 1  # rank 0 alone prints, on one node
    assert_same_command_line_steps(read_metrics(tmp_path / "two"), one)
