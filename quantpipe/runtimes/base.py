"""The interface every inference runtime implements, and the parity check that decides whether
a runtime's numbers are trusted.

One runtime is the reference (quantpipe.runtimes.registry.REFERENCE): the pipeline's accuracy,
the summary's latency/speedup keys and every parity check are its. Another runtime is timed
beside it and is trusted only after its outputs on the test split agree with the reference's
(parity()).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import numpy as np

from quantpipe.criterion import compare, decided
from quantpipe.errors import UserError

# A batch (N, C, S, S) float32 -> the model's first output, logits (N, classes).
Runner = Callable[[np.ndarray], np.ndarray]


class RuntimeUnavailable(UserError):
    """A runtime cannot run a model (cannot read an op, cannot compile, fails a run); str() is
    one line naming the model and saying why. check() records it for a non-reference runtime and the stage goes on;
    raised anywhere else (a run failing mid-benchmark) it stops the stage in that one line."""


class Runtime(Protocol):
    """A runtime. Constructed as Runtime(level) (level: ONNX Runtime's graph optimization level,
    runtime.graph_optimization_level; a runtime that optimizes its own way ignores it), or
    Runtime(level, precision="bf16") when "bf16" is in its `precisions`: the FP32 file computed
    in BF16 (the bf16 row). A runtime without `precisions` runs FP32 only; `lacks` says why
    not the others ({"bf16": "..."})."""
    name: str   # its key in bench.runtimes and in the metrics
    title: str  # how reports spell it

    def version(self) -> str: ...

    def kernels(self, path, batch, threads: int, cpu_flags: dict) -> list[dict]:
        """The kernels the runtime runs model `path`'s compute layers with on `batch` (a latency
        runner of `threads` threads): one {"layer", "kernel", "precision", "isa", "count"} per
        distinct kernel ("isa": the instruction set it runs on, e.g. AMX-INT8, AVX-512 VNNI).
        Optional: the bench records none for a runtime without it."""

    def settings(self, path, cores: int) -> dict:
        """The runtime options the runners of model `path` are made with on `cores` cores,
        recorded beside the timings."""

    def runner(self, path, threads: int) -> Runner:
        """One request at a time with `threads` threads: the latency configuration."""

    def pool(self, path, streams: int, threads: int) -> list[Runner]:
        """`streams` runners meant to run concurrently, one per thread, `threads` threads each:
        the throughput configuration."""


@dataclass(frozen=True)
class Parity:
    """One runtime's outputs against the reference runtime's on the same model and samples."""
    samples: int
    agreement: float       # share of samples whose top-1 class equals the reference's
    max_abs_diff: float    # logit units
    mean_abs_diff: float
    accuracy: float | None  # against the labels, when given
    min_agreement: float
    finite: bool
    # A classifier's agreement on the samples the reference decides by more than the
    # candidate's typical output difference (quantpipe.criterion.decided: two runtimes' INT8
    # kernels round a step apart, and a near-tie of the reference flips with it), and how many
    # those are; None where the difference is as large as most of the reference's margins.
    decided_agreement: float | None = None
    decided_samples: int | None = None
    # A quantized file's agreement with FP32 (the FP32 file on the reference runtime) on this
    # runtime and on the reference one. Two runtimes' INT8 kernels round a step apart; a model
    # whose classes lie within a step of each other then flips between them on many samples,
    # yet each runtime is as faithful to FP32 as the other (ResNet-50 after 5 epochs: 86% top-1
    # agreement between ONNX Runtime and OpenVINO, both at 81.9% with FP32). A runtime that
    # agrees with FP32 no less than the reference does (within one sample) is trusted too.
    fp32_agreement: float | None = None
    reference_fp32_agreement: float | None = None

    @property
    def counted_agreement(self) -> float:
        return self.agreement if self.decided_agreement is None else self.decided_agreement

    @property
    def as_faithful(self) -> bool:
        return (self.fp32_agreement is not None and self.reference_fp32_agreement is not None
                and self.fp32_agreement >= self.reference_fp32_agreement - 1 / max(self.samples, 1))

    @property
    def passed(self) -> bool:
        return self.finite and (self.counted_agreement >= self.min_agreement or self.as_faithful)

    def failure(self, reference: str) -> str | None:
        """Why this runtime's numbers cannot be trusted, or None."""
        if not self.finite:
            return f"it returned non-finite logits where {reference} did not"
        if not self.passed:
            decided = ("" if self.decided_agreement is None else
                       f", {self.decided_agreement:.2%} of the {self.decided_samples} it decides")
            fp32 = ("" if self.fp32_agreement is None else
                    f"; with FP32 {self.fp32_agreement:.2%} against {reference}'s "
                    f"{self.reference_fp32_agreement:.2%}")
            return (f"its predictions agree with {reference}'s on {self.agreement:.2%} of "
                    f"{self.samples} test samples{decided} (max output difference "
                    f"{self.max_abs_diff:.3g}{fp32}), "
                    f"below bench.min_runtime_agreement = {self.min_agreement}")
        return None

    def as_dict(self) -> dict:
        out = {"samples": self.samples, "agreement": self.agreement,
               "max_abs_diff": self.max_abs_diff, "mean_abs_diff": self.mean_abs_diff,
               "min_agreement": self.min_agreement, "passed": self.passed}
        if self.decided_agreement is not None:
            out.update(decided_agreement=self.decided_agreement,
                       decided_samples=self.decided_samples)
        if self.fp32_agreement is not None:
            out.update(fp32_agreement=self.fp32_agreement,
                       reference_fp32_agreement=self.reference_fp32_agreement)
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        return out


# Outputs of the reference, outputs of the candidate -> the share of samples they agree on.
Agree = Callable[[np.ndarray, np.ndarray], float]


def top1_agreement(ref: np.ndarray, out: np.ndarray) -> float:
    return compare(out.argmax(1), ref.argmax(1)).agreement


def parity(reference: Runner, candidate: Runner, x: np.ndarray, y: np.ndarray | None, *,
           batch_size: int, min_agreement: float, label: str = "the candidate",
           reference_title: str = "the reference", agree: Agree = top1_agreement,
           fp32: np.ndarray | None = None) -> Parity:
    """Run both runtimes over x (N, C, S, S) in batches of batch_size and compare their outputs:
    `agree` (top-1 agreement of logits by default; a detector's: matched detections).
    label names the candidate (model and runtime) in the error for outputs of another shape.
    fp32: the FP32 file's outputs on x on the reference runtime, when the model is another
    (Parity.as_faithful)."""
    ref = np.concatenate([reference(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
    out = np.concatenate([candidate(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
    if out.shape != ref.shape:
        raise RuntimeUnavailable(f"{label}: its output has shape {out.shape}, "
                                 f"{reference_title}'s {ref.shape}")
    finite = bool(np.isfinite(out).all() or not np.isfinite(ref).all())
    diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
    diff = diff[np.isfinite(diff)]  # a non-finite output fails through `finite`, not a NaN here
    pred = out.argmax(1)
    return Parity(samples=len(x), agreement=agree(ref, out),
                  max_abs_diff=round(float(diff.max()) if diff.size else 0.0, 6),
                  mean_abs_diff=round(float(diff.mean()) if diff.size else 0.0, 6),
                  accuracy=None if y is None else round(float((pred == y).mean()), 6),
                  min_agreement=min_agreement, finite=finite,
                  **_decided(out, ref),
                  **({} if fp32 is None else {"fp32_agreement": round(agree(fp32, out), 6),
                                              "reference_fp32_agreement": round(agree(fp32, ref), 6)}))


def _decided(out: np.ndarray, ref: np.ndarray) -> dict:
    """criterion.decided's agreement of (N, K) logits (a classifier's), else nothing."""
    if ref.ndim != 2:
        return {}
    found = decided(out, ref)
    return {k: found[k] for k in ("decided_agreement", "decided_samples") if k in found}


@dataclass(frozen=True)
class Check:
    """Whether one runtime may be timed on one model, and trusted."""
    parity: Parity | None  # None: the reference itself, or a runtime that cannot run the model
    failed: str | None     # why the runtime is excluded from "best", or None
    runs: bool             # False: it cannot run the model at all, so it is not timed


def check(runtimes: dict[str, Runtime], reference: Runtime, path, x: np.ndarray,
          y: np.ndarray | None, *, threads: int, batch_size: int,
          min_agreement: float, agree: Agree = top1_agreement,
          fp32_path=None) -> dict[str, Check]:
    """Every runtime on model `path`, each against the reference runtime on the same file (FP32
    ONNX Runtime for the bf16 row: `runtimes` are then the BF16 ones) on x (N, C, S, S): one line
    naming the model and the reason for a runtime that cannot run it or disagrees. fp32_path:
    the FP32 file a quantized `path` was made from (parity's `fp32`)."""
    ref_title = reference.title
    ref_runner = reference.runner(path, threads)  # its errors stop the stage
    fp32 = None
    if fp32_path is not None and str(fp32_path) != str(path):
        run = reference.runner(fp32_path, threads)
        fp32 = np.concatenate([run(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
    checks = {}
    for name, runtime in runtimes.items():
        if runtime is reference:
            checks[name] = Check(parity=None, failed=None, runs=True)
            continue
        try:
            result = parity(ref_runner, runtime.runner(path, threads), x, y,
                            batch_size=batch_size, min_agreement=min_agreement,
                            label=f"{path} on {runtime.title}", reference_title=ref_title,
                            agree=agree, fp32=fp32)
        except RuntimeUnavailable as e:
            checks[name] = Check(parity=None, failed=str(e), runs=False)
            continue
        why = result.failure(ref_title)
        checks[name] = Check(parity=result, failed=why and f"{path} on {runtime.title}: {why}", runs=True)
    return checks


def kernel_table(kernels: list[dict]) -> dict[str, dict]:
    """Kernels as metrics record them: keyed "layer: kernel", because DVC's metrics commands
    (show, diff, exp show) drop lists, so a list of kernels would not reach code review."""
    return {f"{k['layer']}: {k['kernel']}": k for k in kernels}


def describe_kernels(kernels: Iterable[dict]) -> str:
    """'Convolution: brgconv_avx512_amx_I8 (AMX-INT8) x2; ...' for the console."""
    return "; ".join(f"{k['layer']}: {k['kernel']} ({k['isa']}) x{k['count']}"
                     for k in kernels) or "none recorded"
