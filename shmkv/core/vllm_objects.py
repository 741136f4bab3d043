"""vLLM's own KV-cache objects, taken as they are: ``KVCacheConfig``, ``KVCacheGroupSpec``,
the specs and their enums of ``vllm.v1.kv_cache_interface`` (issue 20, item 6).

shmkv's managers and coordinators are written against shmkv's classes of the same names
(``shmkv.core.kv_cache_interface``), and vLLM's callers (its scheduler, ``EngineCore``) test
``isinstance(manager.kv_cache_spec, <vLLM's class>)``. So a vLLM spec given to shmkv becomes a
*bridged* spec: an instance of a class derived from shmkv's class first and vLLM's second.
shmkv's code finds shmkv's fields and methods on it (they come first in the method order), so
it behaves exactly as with shmkv's own spec, and vLLM's code sees an instance of its own class,
with every field of the vLLM object it came from (the ones shmkv lacks included) and vLLM's
methods for whatever shmkv does not define. Configs and groups become shmkv's classes holding
bridged specs; enums become shmkv's enums of the same value (both are ``str`` or ``int``
enums, so they compare equal to vLLM's).

NOTE: nothing here imports vLLM. An object is vLLM's when its class comes from a ``vllm.``
module, and a bridged class is built from the class the object has, so shmkv keeps working
(and this module does nothing) where vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from shmkv.core import kv_cache_interface as S
from shmkv.errors import UsageError

__all__ = ["VllmSpecBridge", "from_vllm", "is_vllm_object", "to_vllm_events"]


def is_vllm_object(obj: Any) -> bool:
    """Whether ``obj``'s class comes from vLLM (a bridged spec is shmkv's already)."""
    return type(obj).__module__.startswith("vllm.") and not isinstance(obj, VllmSpecBridge)


class VllmSpecBridge:
    """Marks a spec built from vLLM's (see the module docstring); ``vllm_spec`` is that
    vLLM object, which pickling sends instead (a bridged class is made at run time)."""

    __slots__ = ()

    @property
    def vllm_spec(self) -> Any:
        return self.__dict__["_vllm_spec"]

    def __reduce__(self):
        return from_vllm, (self.vllm_spec,)


# (shmkv class, vLLM class) -> the bridged class.
_BRIDGES: dict[tuple[type, type], type] = {}


def _bridge_class(ours: type, theirs: type) -> type:
    cls = _BRIDGES.get((ours, theirs))
    if cls is None:
        cls = type(theirs.__name__, (VllmSpecBridge, ours, theirs), {
            "__module__": __name__,
            "__qualname__": f"VllmSpecBridge[{theirs.__name__}]",
            "__doc__": f"shmkv's {ours.__name__}, also an instance of "
                       f"{theirs.__module__}.{theirs.__qualname__}.",
        })
        _BRIDGES[(ours, theirs)] = cls
    return cls


def _shmkv_class(obj: Any) -> type:
    name = type(obj).__name__
    cls = getattr(S, name, None)
    if not isinstance(cls, type):
        raise UsageError(
            f"shmkv has no {name} (vLLM's {type(obj).__module__}.{name} cannot be used here)"
        )
    return cls


def from_vllm(obj: Any) -> Any:
    """``obj`` with every vLLM spec, group, config and enum in it as shmkv's (specs bridged:
    see the module docstring); anything else, shmkv's objects included, unchanged.

    Raises:
        UsageError: a vLLM class shmkv has no counterpart for.
    """
    if isinstance(obj, list):
        return [from_vllm(x) for x in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(from_vllm(x) for x in obj)
    if isinstance(obj, dict):
        return {key: from_vllm(value) for key, value in obj.items()}
    if not is_vllm_object(obj):
        return obj
    if isinstance(obj, enum.Enum):
        cls = getattr(S, type(obj).__name__, None)
        return cls(obj.value) if isinstance(cls, type) and issubclass(cls, enum.Enum) else obj
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    cls = _shmkv_class(obj)
    # A group's role stays vLLM's enum member (shmkv takes any value of its roles): vLLM's
    # code reading the manager's config tests it by identity
    # (``group.role is KVCacheGroupRole.HISPARSE_INDEXER``).
    kwargs = {f.name: getattr(obj, f.name) if f.name == "role" else
              from_vllm(getattr(obj, f.name)) for f in dataclasses.fields(cls)
              if f.init and hasattr(obj, f.name)}
    ours = cls(**kwargs)  # shmkv's checks and derived fields
    if not isinstance(ours, S.KVCacheSpec):
        return ours
    bridged = object.__new__(_bridge_class(cls, type(obj)))
    state = bridged.__dict__
    state.update(obj.__dict__)  # vLLM's fields, the ones shmkv lacks too
    state.update(ours.__dict__)
    state["_vllm_spec"] = obj
    return bridged


def to_vllm_events(events: list) -> list:
    """shmkv's KV events as vLLM's classes of the same name and fields (what vLLM's callers
    of a manager built from vLLM's config test for); vLLM is imported only here, when asked.
    Their msgpack bytes are the same either way."""
    from vllm.distributed import kv_events as V

    out = []
    for event in events:
        cls = getattr(V, type(event).__name__)
        names = getattr(cls, "__struct_fields__", ())
        out.append(cls(**{name: getattr(event, name) for name in names if hasattr(event, name)}))
    return out
