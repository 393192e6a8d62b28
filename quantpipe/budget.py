"""The memory budget of a stage (params.yaml `resources.memory_mb`) and what a model costs in it.

What grows with the model and the data (an ONNX Runtime session that returns every
intermediate tensor to calibrate, a training step, an evaluation pass) is sized before it is
allocated: Budget.batch gives the largest batch whose bytes fit in what the budget leaves beside
what the process already holds, and stops in one line naming the key when one sample does not.
The bytes per sample come from the ONNX graph itself (activations: shape inference at the
prepared input size) or, for training, from what autograd saves (quantpipe.models.saved_bytes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from quantpipe.errors import UserError
from quantpipe.memprobe import machine_memory_mb
from quantpipe.schemas.resources import ResourcesParams

MB = 2**20
# resources.memory_mb: null is this share of the machine's memory.
SHARE = 3


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class Budget:
    """The peak resident memory a stage may reach, and how it was set (for messages)."""
    total_mb: float
    source: str

    @classmethod
    def of(cls, p: ResourcesParams, machine_mb: float | None = None) -> "Budget":
        if p.memory_mb is not None:
            return cls(float(p.memory_mb), f"resources.memory_mb = {p.memory_mb}")
        machine_mb = machine_memory_mb() if machine_mb is None else machine_mb
        return cls(round(machine_mb / SHARE, 1),
                   f"resources.memory_mb: null, a third of this machine's {machine_mb:.0f} MiB")

    def left_bytes(self) -> int:
        """What the budget leaves beside what this process holds now."""
        if self.total_mb == float("inf"):
            return 2**62
        return max(0, int(self.total_mb * MB) - rss_bytes())

    def batch(self, per_sample: float, *, cap: int, what: str, fixed: float = 0,
              fix: str = "") -> int:
        """The largest batch of at most `cap` samples whose `fixed` + batch x `per_sample`
        bytes fit in left_bytes(); a UserError naming `what`, the budget and `fix` (the other
        key that would help) when a single sample does not."""
        left = self.left_bytes() - fixed
        if per_sample <= 0:
            return max(1, cap)
        fit = int(left // per_sample)
        if fit < 1:
            need = (fixed + per_sample + rss_bytes()) / MB
            raise UserError(f"{what} needs about {need:,.0f} MiB for one sample, more than "
                            f"{self.source} MiB allows; raise resources.memory_mb"
                            + (f" or {fix}" if fix else ""))
        return max(1, min(cap, fit))

    def record(self) -> dict:
        return {"memory_budget_mb": round(self.total_mb)}


# For library calls outside a stage (tests, studies): batches as the caller asks.
UNLIMITED = Budget(float("inf"), "no limit")


def load(path: Path | None = None) -> Budget:
    """The budget of params.yaml's `resources` section."""
    from quantpipe import params

    return Budget.of(params.load(ResourcesParams) if path is None
                     else params.load(ResourcesParams, path))


@dataclass(frozen=True)
class Activations:
    """What one sample costs a model's session, in bytes, and what it costs whatever the batch."""
    every: int    # all intermediate tensors: what a calibrating or debugging session returns
    live: int     # the most alive at once, in graph order: what an inference session holds
    weights: int  # the initializers, once per session
    fixed: int = 0  # intermediate tensors that do not grow with the batch (a QDQ model's weights)


def activations(model: onnx.ModelProto, input_shape: tuple[int, ...]) -> Activations:
    """Bytes per sample of `model` at inputs (N, *input_shape), by ONNX shape inference at
    batches 1 and 2 (what grows with N is per sample; the rest, such as a QDQ model's
    dequantized weights, is fixed). A tensor whose shape stays unknown counts nothing: the
    planners leave a margin for it."""
    one, two = _tensor_bytes(model, input_shape, 1), _tensor_bytes(model, input_shape, 2)
    per_sample = {name: max(0, two[name] - one.get(name, 0)) for name in two}
    fixed = sum(max(0, 2 * one.get(name, 0) - two[name]) for name in two)
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    inputs = [i.name for i in graph.input if i.name not in initializers]
    graph_outputs = {o.name for o in graph.output}
    last_use = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            last_use[name] = i
    alive = {name: per_sample.get(name, 0) for name in inputs}
    every = peak = 0
    for i, node in enumerate(graph.node):
        for name in node.output:
            alive[name] = per_sample.get(name, 0)
            every += per_sample.get(name, 0)
        peak = max(peak, sum(alive.values()))
        for name in set(node.input):
            if last_use.get(name) == i and name in alive and name not in graph_outputs:
                del alive[name]
    weights = sum(int(np.prod(t.dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(
        t.data_type)).itemsize for t in graph.initializer)
    return Activations(every=every, live=peak, weights=weights, fixed=fixed)


def _tensor_bytes(model: onnx.ModelProto, input_shape: tuple[int, ...], batch: int) -> dict[str, int]:
    """{tensor: bytes} of every tensor whose shape inference finds at inputs (batch,
    *input_shape)."""
    fixed = copy.deepcopy(model)
    initializers = {i.name for i in fixed.graph.initializer}
    inputs = [i for i in fixed.graph.input if i.name not in initializers]
    if inputs:
        dims = inputs[0].type.tensor_type.shape.dim
        for dim, value in zip(dims, (batch, *input_shape)):
            dim.Clear()
            dim.dim_value = value
    del fixed.graph.value_info[:]
    try:
        fixed = onnx.shape_inference.infer_shapes(fixed, strict_mode=False, data_prop=True)
    except Exception:  # a model over 2 GB, an op onnx does not know: shapes stay unknown
        pass
    sizes = {}
    for value in [*fixed.graph.value_info, *fixed.graph.output, *inputs]:
        t = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        if t.elem_type and dims and all(d > 0 for d in dims):
            itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
            sizes[value.name] = int(np.prod(dims)) * itemsize
    return sizes


def inference_batch(memory: Budget, model: onnx.ModelProto, input_shape: tuple[int, ...], *,
                    cap: int, what: str, fix: str = "", sessions: int = 1) -> int:
    """Samples per run of `sessions` inference sessions of `model` alive at once (a variant's
    and FP32's) within `memory`: each sample costs its float32 input and the live activations
    (ONNX Runtime's arena measured 0.7-0.9x of them on ResNet-50 at 224 px, batches 64-256),
    each session its weights twice (a copy and the prepacked kernels' layout)."""
    acts = activations(model, input_shape)
    return memory.batch(sessions * (4 * int(np.prod(input_shape)) + acts.live), cap=cap,
                        fixed=sessions * 2 * acts.weights, what=what, fix=fix)


# A training step's peak beyond the weights, per sample, in units of what autograd saves for
# backward (quantpipe.models.saved_bytes): ResNet-50 at 224 px saves 82 MB a sample and peaked
# at 1.12x that (batch 64, 2 cores); backward's transient gradients make the rest. A no-grad
# pass holds a few layers' activations at a time: half of it is generous.
TRAIN_SAVED = 1.5
EVAL_SAVED = 0.5
# Weights, their gradients and Adam's two moments.
TRAIN_PARAMETER_COPIES = 4


@dataclass(frozen=True)
class TrainingPlan:
    micro_batch: int  # samples per forward/backward; gradients accumulate to the batch
    eval_batch: int   # samples per no-grad pass (validation, scoring)

    @property
    def record(self) -> dict:
        return {"micro_batch": self.micro_batch, "eval_batch": self.eval_batch}


def training_plan(memory: Budget, saved_per_sample: float, parameter_bytes: int, batch_size: int,
                  *, what: str, key: str) -> TrainingPlan:
    """Micro-batches that keep a training step of `batch_size` samples within `memory` (the
    fewest equal parts of the batch that fit), and the batch of a no-grad pass."""
    fixed = TRAIN_PARAMETER_COPIES * parameter_bytes
    fit = memory.batch(TRAIN_SAVED * saved_per_sample, cap=batch_size, fixed=fixed, what=what,
                       fix=f"lower {key}")
    parts = -(-batch_size // fit)
    return TrainingPlan(micro_batch=-(-batch_size // parts),
                        eval_batch=memory.batch(EVAL_SAVED * saved_per_sample, cap=256,
                                                fixed=parameter_bytes, what=what))
