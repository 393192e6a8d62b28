"""The whole of params.yaml at once: every section, validated. For tests, scripts and
`python -m quantpipe.schemas.all` (check a params file); stages load only the sections they read
(quantpipe.params.load), so this module is no stage's dependency."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from quantpipe import params
from quantpipe.errors import UserError
from quantpipe.schemas.bench import BenchParams
from quantpipe.schemas.detect import DetectParams
from quantpipe.schemas.evaluate import EvaluateParams
from quantpipe.schemas.export import ExportParams
from quantpipe.schemas.gates import GatesParams
from quantpipe.schemas.prepare import PrepareParams
from quantpipe.schemas.quantize_dynamic import QuantizeDynamicParams
from quantpipe.schemas.quantize_qat import QuantizeQATParams
from quantpipe.schemas.quantize_static import QuantizeStaticParams
from quantpipe.schemas.resources import ResourcesParams
from quantpipe.schemas.review import ReviewParams
from quantpipe.schemas.runtime import RuntimeParams
from quantpipe.schemas.simplify import SimplifyParams
from quantpipe.schemas.train import TrainParams


@dataclass(frozen=True)
class Params:
    seed: int = 0
    prepare: PrepareParams = field(default_factory=PrepareParams)
    train: TrainParams = field(default_factory=TrainParams)
    export: ExportParams = field(default_factory=ExportParams)
    simplify: SimplifyParams = field(default_factory=SimplifyParams)
    quantize_dynamic: QuantizeDynamicParams = field(default_factory=QuantizeDynamicParams)
    quantize_static: QuantizeStaticParams = field(default_factory=QuantizeStaticParams)
    quantize_qat: QuantizeQATParams = field(default_factory=QuantizeQATParams)
    detect: DetectParams = field(default_factory=DetectParams)
    runtime: RuntimeParams = field(default_factory=RuntimeParams)
    resources: ResourcesParams = field(default_factory=ResourcesParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    bench: BenchParams = field(default_factory=BenchParams)
    gates: GatesParams = field(default_factory=GatesParams)
    review: ReviewParams = field(default_factory=ReviewParams)


def load_params(path: Path = params.PARAMS_FILE) -> Params:
    """Read and validate every section of params.yaml; raise UserError naming the first bad key."""
    return parse_params(params.read(path), source=str(path))


def parse_params(raw: dict, source: str = "params") -> Params:
    """Params from a plain mapping (the parsed YAML)."""
    if not isinstance(raw, dict):
        raise UserError(f"{source}: top level: expected a mapping, got {raw!r}")
    unknown = sorted(set(raw) - set(params.sections()))
    if unknown:
        raise UserError(f"{source}: unknown key {unknown[0]}; allowed keys: {', '.join(params.sections())}")
    cls = {f: getattr(Params(), f).__class__ for f in Params.__dataclass_fields__ if f != "seed"}
    return Params(seed=params.parse_seed(raw, source),
                  **{name: params.section(c, raw, source) for name, c in cls.items()})


if __name__ == "__main__":
    try:
        load_params(Path(sys.argv[1]) if len(sys.argv) > 1 else params.PARAMS_FILE)
    except UserError as e:
        sys.exit(f"error: {e}")
    print("params: every section is valid")
