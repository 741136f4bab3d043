"""A light request, with the attributes of vLLM 0.34.0's ``vllm.v1.request.Request`` that the
KV-cache layer reads (same names), and small stand-ins for the objects it refers to.

    hasher = RequestBlockHasher(16, sha256, none_hash(sha256))
    req = Request("r1", prompt_token_ids, block_hasher=hasher, cache_salt="tenant-a")
    req.block_hashes                   # one hash per full 16-token block of the prompt
    req.append_output_token_ids([7, 8])  # extends all_token_ids, then block_hashes

``block_hashes`` only grows: the hasher is called at construction and after every append,
and returns the hashes of the blocks that became full (see :mod:`shmkv.hashing`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from shmkv.errors import UsageError

__all__ = [
    "ConstantList",
    "LoRARequest",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "Request",
]

T = TypeVar("T")


class ConstantList(Sequence[T]):
    """A read-only view of a list (vLLM's ``ConstantList``): indexing a slice returns a list;
    every mutating method raises TypeError."""

    __slots__ = ("_x",)

    def __init__(self, x: list[T]) -> None:
        self._x = x

    @overload
    def __getitem__(self, item: int) -> T: ...

    @overload
    def __getitem__(self, item: slice) -> list[T]: ...

    def __getitem__(self, item):
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self):
        return iter(self._x)

    def __contains__(self, item: object) -> bool:
        return item in self._x

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            return self._x == other._x
        return self._x == other

    __hash__ = None  # type: ignore[assignment]

    def index(self, item: Any, start: int = 0, stop: int | None = None) -> int:
        return self._x.index(item, start, len(self._x) if stop is None else stop)

    def copy(self) -> list[T]:
        return self._x.copy()

    def __repr__(self) -> str:
        return f"ConstantList({self._x})"

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Cannot modify a constant list")

    append = extend = insert = pop = remove = clear = _read_only
    __setitem__ = __delitem__ = __iadd__ = _read_only


@dataclass(frozen=True)
class LoRARequest:
    """The fields of vLLM's ``LoRARequest`` that KV caching reads: ``lora_name`` and
    ``lora_path`` enter every block hash; ``adapter_id`` (``lora_int_id``) and ``name`` go
    into ``BlockStored`` events."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise UsageError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise UsageError("lora_path cannot be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class PlaceholderRange:
    """Where a multimodal item's placeholder tokens sit in the prompt."""

    offset: int
    length: int


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One multimodal item of a request, in vLLM's field order; block hashing reads
    ``identifier`` and ``mm_position``. A request's items are sorted by offset and do not
    overlap."""

    data: Any
    modality: str
    identifier: str
    mm_position: PlaceholderRange
    mm_hash: str | None = None


class Request:
    """The token state and cache-relevant metadata of one request, under vLLM's names.

    Args:
        request_id: any id.
        prompt_token_ids: the prompt; None when only ``prompt_embeds`` is given, in which
            case ``all_token_ids`` starts as zeros, as in vLLM.
        block_hasher: called as ``block_hasher(request)`` to get new full-block hashes
            (e.g. a :class:`shmkv.hashing.RequestBlockHasher`); without one,
            ``block_hashes`` stays empty.
        cache_salt: isolates a tenant's prefixes (hashed into the block at token 0).
        lora_request: an object with ``lora_name`` / ``lora_path`` (and ``adapter_id`` /
            ``name`` for events), e.g. :class:`LoRARequest` or vLLM's.
        mm_features: multimodal items with ``identifier`` and ``mm_position`` (``offset``,
            ``length``), sorted by offset.
        prompt_embeds: one row per prompt position (torch tensor or numpy array).
        prompt_is_token_ids: mixed prompts: True where the position is a real token; the
            other positions read as 0 in ``all_token_ids``.
        session_id: published in ``BlockStored`` events.
        prefix_cache_hit_limit: how many leading tokens may be read from the prefix cache:
            None (the default) for no limit, 0 to skip the lookup (vLLM does for prompt
            logprobs), n to score the prompt from token n.
    """

    def __init__(
        self,
        request_id: Any,
        prompt_token_ids: Sequence[int] | None,
        *,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
        mm_features: Sequence[Any] | None = None,
        prompt_embeds: Any = None,
        prompt_is_token_ids: Sequence[bool] | None = None,
        session_id: str | None = None,
        prefix_cache_hit_limit: int | None = None,
    ) -> None:
        if block_hasher is not None and not callable(block_hasher):
            raise UsageError(f"block_hasher must be callable, got {type(block_hasher).__name__}")
        self.request_id = request_id
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.session_id = session_id
        if prefix_cache_hit_limit is not None and prefix_cache_hit_limit < 0:
            raise UsageError(f"prefix_cache_hit_limit must be None or >= 0, got "
                             f"{prefix_cache_hit_limit}")
        self.prefix_cache_hit_limit = prefix_cache_hit_limit
        self.mm_features = list(mm_features) if mm_features else []
        self.prompt_embeds = prompt_embeds
        self.prompt_is_token_ids = prompt_is_token_ids
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}

        if prompt_token_ids is None:
            if prompt_embeds is None:
                raise UsageError("Neither prompt_token_ids nor prompt_embeds were defined.")
            self.prompt_token_ids = None
            self.num_prompt_tokens = len(prompt_embeds)
            self._all_token_ids: list[int] = [0] * self.num_prompt_tokens
        else:
            self.prompt_token_ids = list(prompt_token_ids)
            self.num_prompt_tokens = len(self.prompt_token_ids)
            if prompt_embeds is not None and len(prompt_embeds) != self.num_prompt_tokens:
                raise UsageError(
                    "Prompt token ids and prompt embeds had different lengths"
                    f" prompt_token_ids={self.num_prompt_tokens}"
                    f" prompt_embeds={len(prompt_embeds)}"
                )
            if prompt_is_token_ids is None:
                self._all_token_ids = self.prompt_token_ids.copy()
            else:
                if len(prompt_is_token_ids) != self.num_prompt_tokens:
                    raise UsageError(
                        f"prompt_is_token_ids has {len(prompt_is_token_ids)} entries for "
                        f"{self.num_prompt_tokens} prompt tokens"
                    )
                self._all_token_ids = [
                    t if is_tok else 0
                    for t, is_tok in zip(self.prompt_token_ids, prompt_is_token_ids, strict=True)
                ]
        self._output_token_ids: list[int] = []
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)
        self.num_computed_tokens = 0
        # Token position where this prompt was seen to diverge from another one that shares
        # its prefix (0: none); the managers keep the cache tail ending there.
        self.shared_prefix_boundary = 0

        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def get_max_cache_hit_length(self, bound: int | None = None) -> int:
        """The longest prefix-cache hit allowed: ``num_tokens - 1`` (the last token is
        recomputed for its logits), ``prefix_cache_hit_limit`` and ``bound``, whichever is
        least."""
        limits = (self.num_tokens - 1, self.prefix_cache_hit_limit, bound)
        return min(limit for limit in limits if limit is not None)

    @property
    def skip_reading_external_kv(self) -> bool:
        """Whether a KV connector's hits are skipped: they are not bounded by the hit
        limit, so a bounded request reads the local prefix cache only."""
        return self.prefix_cache_hit_limit is not None

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens, then hash any blocks they completed."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Compute the hashes of new full blocks and append them to ``block_hashes``."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_block_hashes={len(self.block_hashes)})"
        )
