"""How JSON answers carry non-finite numbers (a NaN loss, an infinite grad_norm): as the strings "NaN",
"Infinity" and "-Infinity".

Every result must be answerable whatever numbers it holds (docs/architecture.md §What durability promises). Standard
JSON has no token for them, and the tinker SDK (0.38) parses answers with orjson, which refuses the NaN/Infinity
tokens Python's json writes; a null would fail the SDK's pydantic models (`metrics: Dict[str, float]`). Pydantic's
lax float parsing turns these three strings back into float('nan'), float('inf') and float('-inf'), so the SDK's
objects hold the very numbers the engine computed, and any strict JSON parser can read the answer."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by its string name (containers copied, the rest as is)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


class WireJSONResponse(JSONResponse):
    """The API's JSON response: strict JSON always, non-finite floats as strings (see the module docstring)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(finite_json(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
