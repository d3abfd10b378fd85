"""How the profile names what is wrong: pydantic's error locations as key paths
(`models[0].kv_fration`), and its messages in the profile's words."""

from __future__ import annotations

from typing import Any

# Keys a vLLM or SGLang user may write for what the appliance does not do yet (or calls otherwise):
# refused by name.
NOT_BUILT = {
    "tensor_parallel_size": "the appliance's key is `tensor_parallel` (1 or 2)",
    "pipeline_parallel_size": "pipeline parallelism is not built",
}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names every bad key path and why."""


def key_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(profile)"


def message(err: dict[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return NOT_BUILT.get(str(err["loc"][-1]), "unknown key")
    if err["type"] == "missing":
        return "required key is missing"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")
