"""A NIXL agent for one end of the rings: which NIXL package, which UCX devices, which progress mode.

Both ends import this; it loads neither torch nor CUDA (NIXL's Python API imports torch only when a
caller already has). The engine host's agent is a target: remote front ends WRITE and READ its
registered memory, and over transports without RDMA (TCP, shared memory) UCX completes those
operations in the target's progress thread. NIXL's Python API starts that thread with a 0 us poll
timeout, a core spinning for good; `make_agent(..., progress_thread=True)` gives it a 1 ms timeout
instead, so it sleeps in poll() on the worker's event descriptor and wakes on traffic.
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import psutil

# The poll() timeout of the target's progress thread (NIXL rounds it up to whole ms).
PROGRESS_POLL_US = 1000
# Where NIXL is published, newest CUDA first; the CPU path needs no CUDA from any of them.
_PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl")


class NixlUnavailableError(RuntimeError):
    """NIXL cannot be used here: no package is installed, or its UCX backend did not start."""


def load_nixl() -> ModuleType:
    """The installed NIXL Python package (nixl-cu13, nixl-cu12 or nixl)."""
    failures = []
    for name in _PACKAGES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # installed, but something it needs is not
                failures.append(f"{name}: {e}")
            continue
        except ImportError as e:  # installed, but a library it loads is missing
            failures.append(f"{name}: {e}")
            continue
        if hasattr(module, "nixl_agent"):
            _quiet(logging.getLogger("nixl"))
            return module
    why = f" ({'; '.join(failures)})" if failures else ""
    raise NixlUnavailableError(
        "frontend.transport 'nixl' needs NIXL: pip install nixl-cu12 (or nixl-cu13; the CPU path "
        f"uses neither CUDA build), or install blink-appliance[dpu]{why}"
    )


def _quiet(logger: logging.Logger) -> None:
    """NIXL logs to stdout at INFO; the daemon's stdout carries only its URL (scripts read it)."""
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (None: no local interface does, or a name)."""
    try:
        wanted = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) == wanted:
                        return name
                except ValueError:
                    continue
    return None


def ucx_defaults() -> dict[str, str]:
    """What UCX runs with unless the profile or the environment says otherwise."""
    # Two WRITEs that completed in order must land in host memory in order (a payload before the
    # word that publishes it), and PCIe relaxed ordering would let a NIC reorder them. UCX warns
    # about the variables of transports it did not load (that one, without an RDMA NIC).
    defaults = {"UCX_IB_PCI_RELAXED_ORDERING": "no", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    if not rdma_devices():
        # Nothing for the InfiniBand modules to drive, and the libnl they load crashes the process
        # at exit (SIGSEGV in rtnl_tc_unregister, NIXL 1.5.1's bundled UCX, a host without RDMA).
        defaults["UCX_MODULES"] = "^ib,rdmacm"
    return defaults


def rdma_devices() -> list[str]:
    """The host's RDMA devices (mlx5_0, ...), as the kernel lists them."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def apply_ucx_env(env: Mapping[str, str]) -> None:
    """Set UCX's variables for this process: `env` (the profile's) over the environment, and the
    defaults where neither sets them. UCX reads them when an agent's context is created."""
    for key, value in {**ucx_defaults(), **env}.items():
        if key in env or key not in os.environ:
            os.environ[key] = value


def make_agent(name: str, *, progress_thread: bool) -> Any:
    """A NIXL agent with the UCX backend. `progress_thread`: a target's, sleeping between events."""
    nixl = load_nixl()
    apply_ucx_env({})
    config = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    api = importlib.import_module(f"{nixl.__name__}._api")
    base = api.nixlBind.nixlAgentConfig

    class _PollingConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            super().__setattr__(key, PROGRESS_POLL_US if key == "pthrDelay" else value)

    if progress_thread:
        api.nixlBind.nixlAgentConfig = _PollingConfig
    try:
        agent = nixl.nixl_agent(name, config)
    except Exception as e:  # noqa: BLE001 - NIXL's binding raises its own error classes
        raise NixlUnavailableError(
            f"NIXL's UCX backend did not start ({e}); the log above says why"
        ) from None
    finally:
        api.nixlBind.nixlAgentConfig = base
    if "UCX" not in agent.backends:  # NIXL skips a backend whose plugin is missing, with a warning
        raise NixlUnavailableError("NIXL has no UCX plugin: reinstall nixl-cu12 (or nixl-cu13)")
    return agent
