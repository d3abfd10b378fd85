"""The profile's `[dpu]` section: how a front end on another host reaches the rings over NIXL. Defined
with the link it configures (the ring agent, the front end's remote rings and the handshake read it);
profile.py embeds it as `Profile.dpu`, so its errors name their key (`dpu.listen: ...`)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, field_validator


def _ucx_name(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.:-]+", v):
        raise ValueError(f"{v!r} is not a UCX device or transport name")
    return v


UcxName = Annotated[StrictStr, AfterValidator(_ucx_name)]


class DpuSection(BaseModel):
    """Where a `transport = "nixl"` front end runs and how it reaches the engine host's rings: the
    engine host's ring agent listens on `listen`:`port` (that interface only) and hands NIXL metadata
    to a front end that proves the shared secret (docs/dpu.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    frontend_host: str = "127.0.0.1"  # where `blink-appliance frontend` runs (the DPU's name or address)
    listen: str = "127.0.0.1"  # engine-host address the ring agent binds: one interface, never all
    connect: str | None = None  # the address the front end dials (default: listen)
    port: int = Field(default=7400, ge=1, le=65535)  # the ring agent's handshake port
    backend: Literal["UCX"] = "UCX"  # NIXL backend
    # UCX_NET_DEVICES for both sides, e.g. "mlx5_0:1" (port 1 of a ConnectX/BlueField NIC) or an
    # interface name for TCP; and UCX_TLS, e.g. ["rc", "sm", "self"] or ["tcp"]. Empty: UCX picks.
    ucx_devices: list[UcxName] = Field(default_factory=list)
    ucx_transports: list[UcxName] = Field(default_factory=list)
    # File holding the shared secret (at least 32 bytes); env BLINK_DPU_SECRET replaces it.
    secret_file: str | None = None
    connect_timeout_s: float = Field(default=5.0, gt=0, le=300)  # one handshake, and one transfer

    @field_validator("listen")
    @classmethod
    def _one_interface(cls, v: str) -> str:
        if v in ("0.0.0.0", "::", ""):
            raise ValueError(f"{v!r} listens on every interface; name the one the front end reaches")
        return v

    @property
    def dial_address(self) -> str:
        return self.connect or self.listen

    def ucx_env(self) -> dict[str, str]:
        """The UCX variables both agents run with."""
        pairs = (("UCX_NET_DEVICES", self.ucx_devices), ("UCX_TLS", self.ucx_transports))
        return {key: ",".join(names) for key, names in pairs if names}
