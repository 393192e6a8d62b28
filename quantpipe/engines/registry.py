"""The static quantization engines quantize_static.engine may name. Adding one = a module with a
class implementing quantpipe.engines.base.StaticEngine, and its class in the list below (or
ENGINES.register(cls) from your own code before the stage runs)."""

from __future__ import annotations

from quantpipe.engines.base import StaticEngine
from quantpipe.engines.nncf_ptq import NNCFStatic
from quantpipe.engines.ort_static import OnnxRuntimeStatic
from quantpipe.errors import UserError
from quantpipe.params import PARAMS_FILE
from quantpipe.registry import Registry

ENGINES = Registry("quantize_static.engine", [OnnxRuntimeStatic, NNCFStatic])


def get(name: str) -> StaticEngine:
    """The engine called `name`; one line naming params.yaml and the key otherwise."""
    try:
        return ENGINES.get(name)()
    except UserError as e:
        raise UserError(f"{PARAMS_FILE}: {e}") from None
