"""SGLang's host memory pools as kvtier namespaces and pages, read by duck typing (no SGLang import).

Each pool SGLang registers (the KV pool, MHA or MLA; side pools such as Mamba state or SWA KV) gets
its own namespace: the model, the pool's layout (page size, layers, heads, head size, dtype, the
host layout ``page_first``/``layer_first``/..., the pool's class), the shard it belongs to (TP
rank for sharded KV; MLA KV is the same on every TP rank, so its pages are shared by them), the
deployment's namespace salt. One object holds one page, byte for byte as the pool's flat data page
(``get_data_page(i, flat=True)``): a page of one layout is never read into another, since the key
and the object header both name the layout.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from typing import Sequence

import blake3
import torch

from kvtier.errors import ConfigError
from kvtier.keys import KEY_SIZE, ChunkSpan, Namespace
from kvtier.layout import DTYPE_SIZES, KVLayout


@dataclass(frozen=True)
class Shard:
    """Where one SGLang process sits in its deployment (HiCacheStorageConfig's ranks)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1

    @property
    def stage(self) -> str:
        """The parts of a shard that hold different layers or token slices (never shared)."""
        parts = [f"pp{self.pp_rank}/{self.pp_size}"] if self.pp_size > 1 else []
        parts += [f"cp{self.cp_rank}/{self.cp_size}"] if self.cp_size > 1 else []
        parts += [f"dcp{self.dcp_rank}/{self.dcp_size}"] if self.dcp_size > 1 else []
        return "-".join(parts)


def _dtype(pool) -> str | None:
    name = str(pool.dtype).removeprefix("torch.")
    return name if name in DTYPE_SIZES else None


def pool_layout(pool, name: str, shard: Shard, replicated: bool) -> tuple[KVLayout, int]:
    """The layout of ``pool``'s pages and the tokens one page object counts. ``replicated``: the
    pool's pages are the same on every TP rank (MLA KV), so its layout names no TP rank."""
    tp_rank, tp_size = (0, 1) if replicated else (shard.tp_rank, shard.tp_size)
    group = f"sglang-{name}" + (f"-{shard.stage}" if shard.stage else "")
    arrangement = f"sglang-{pool.layout}-{type(pool).__name__}"
    dtype, page_size = _dtype(pool), getattr(pool, "page_size", 1) or 1
    common = dict(tp_rank=tp_rank, tp_size=tp_size, group=group, arrangement=arrangement)
    if dtype and hasattr(pool, "kv_cache_dim"):  # MLA: one latent vector per token and layer
        return KVLayout(pool.layer_num, 1, pool.kv_cache_dim, dtype, page_size, kv_parts=1, **common), page_size
    if dtype and hasattr(pool, "head_num") and getattr(pool, "v_head_dim", pool.head_dim) == pool.head_dim:
        return KVLayout(pool.layer_num, pool.head_num, pool.head_dim, dtype, page_size, **common), page_size
    # any other pool (Mamba state, K-only, asymmetric heads): a page is an opaque run of bytes
    page = pool.get_dummy_flat_data_page()
    return KVLayout(1, 1, page.numel() * page.element_size(), "uint8", 1, kv_parts=1, **common), 1


@dataclass(frozen=True)
class BoundPool:
    """One registered host pool, bound to its namespace."""

    name: str
    pool: object
    namespace: Namespace
    page_tokens: int  # tokens one page object counts (its span's length)
    page_size: int  # host slots per page (SGLang's host_indices step)
    page_bytes: int
    page_dtype: torch.dtype
    page_elements: int

    @classmethod
    def bind(cls, name: str, pool, model: str, shard: Shard, replicated: bool, salt: bytes) -> "BoundPool":
        layout, tokens = pool_layout(pool, name, shard, replicated)
        page = pool.get_dummy_flat_data_page()
        size = page.numel() * page.element_size()
        if layout.payload_bytes(tokens) != size:
            raise ConfigError(f"SGLang pool {name!r} ({type(pool).__name__}): a page is {size} bytes, "
                              f"its geometry says {layout.payload_bytes(tokens)}")
        return cls(name, pool, Namespace(model, layout, tenant_salt=salt), tokens,
                   getattr(pool, "page_size", 1) or 1, size, page.dtype, page.numel())

    def spans(self, keys: list[str], first_page: int = 0, salt: bytes = b"") -> list[ChunkSpan]:
        """kvtier's key of each of SGLang's page hashes (already chained over the prefix) in this
        pool's namespace, ``salt`` a request's own; ``first_page``: where ``keys`` start."""
        head, t = self.namespace.root + len(salt).to_bytes(4, "little") + salt, self.page_tokens
        return [ChunkSpan(blake3.blake3(head + key.encode()).digest(KEY_SIZE), (first_page + i) * t, (first_page + i + 1) * t)
                for i, key in enumerate(keys)]

    # -- pages --------------------------------------------------------------------------------

    def copy_out(self, index: int, dest: memoryview) -> None:
        """The page at host slot ``index`` into ``dest`` (exactly one page), in one copy: the
        pool's page view (``flat=False``) in C order is its flat page."""
        view = self.pool.get_data_page(index, flat=False)
        if view.numel() != self.page_elements or view.dtype != self.page_dtype:
            raise ValueError(f"page of {view.numel()} {view.dtype} for pool {self.name!r} of {self.page_elements} {self.page_dtype}")
        self._writable(dest).view(view.shape).copy_(view)

    def copy_out_each(self, starts: Sequence[int], dests: Sequence[memoryview]) -> None:
        """The pages at host slots ``starts`` into ``dests`` (one page each). Where the pool's pages
        lie evenly spaced in its buffer and the dests evenly spaced in theirs (a run of pages into
        slots reserved together), one strided copy moves them all: copied one by one, the Python
        around each page's copy cost a third of the copy. Otherwise page by page."""
        run = self._run(starts, dests) if len(starts) > 1 else None
        if run is None:
            for start, dest in zip(starts, dests):
                self.copy_out(start, dest)
            return
        src, dst = run
        dst.copy_(src)

    def _run(self, starts: Sequence[int], dests: Sequence[memoryview]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(source, destination) tensors of all the pages, each of shape (pages, *page), where both
        are evenly spaced, else None. The host slots are checked one by one, the pool's views at
        the run's first, second and last page (SGLang's host pools slice one buffer by slot, so
        its page i of an evenly spaced run is then exactly the view the run gives), and every
        dest's address (``ctypes``: a tenth of a tensor's cost a view)."""
        n, step = len(starts), starts[1] - starts[0]
        if step <= 0 or any(b - a != step for a, b in zip(starts, starts[1:])):
            return None
        first, second, last = (self.pool.get_data_page(start, flat=False) for start in (starts[0], starts[1], starts[-1]))
        if first.numel() != self.page_elements or first.dtype != self.page_dtype:
            return None
        shape, stride, origin = first.shape, first.stride(), first.storage_offset()
        storage, gap = first.untyped_storage().data_ptr(), second.storage_offset() - origin
        if gap <= 0:  # one view for two slots, or pages laid out backwards: page by page
            return None
        for i, view in ((1, second), (n - 1, last)):
            if (view.storage_offset() != origin + i * gap or view.shape != shape or view.stride() != stride
                    or view.untyped_storage().data_ptr() != storage):
                return None
        buffer = dests[0].obj  # the buffer the dests are views of (an arena), if it holds them all
        if any(dest.obj is not buffer or len(dest) != self.page_bytes or dest.readonly for dest in dests):
            return None
        whole = torch.frombuffer(buffer, dtype=torch.uint8)
        addresses = [ctypes.addressof(ctypes.c_char.from_buffer(dest)) - whole.data_ptr() for dest in dests]
        at, spacing, item = addresses[0], addresses[1] - addresses[0], first.element_size()
        if (at % item or spacing % item or spacing < self.page_bytes
                or any(a != at + i * spacing for i, a in enumerate(addresses))):
            return None
        dst = whole[at : at + (n - 1) * spacing + self.page_bytes].view(self.page_dtype)
        dst = dst.as_strided((n, self.page_elements), (spacing // item, 1)).view(n, *shape)
        return first.as_strided((n, *shape), (gap, *stride), origin), dst

    def tensor_out(self, page: torch.Tensor, dest: memoryview) -> None:
        """A page tensor SGLang hands (a flat data page) into ``dest``."""
        if page.numel() * page.element_size() != self.page_bytes:
            raise ValueError(f"page of {page.numel() * page.element_size()} bytes for pool {self.name!r} of {self.page_bytes}-byte pages")
        self._writable(dest).view(page.dtype).view(page.shape).copy_(page)

    def _writable(self, dest: memoryview) -> torch.Tensor:
        return torch.frombuffer(dest, dtype=self.page_dtype, count=self.page_elements)

    def copy_in(self, index: int, payload: memoryview) -> None:
        """A page's bytes into host slot ``index``."""
        self.pool.set_from_flat_data_page(index, self.as_tensor(payload))

    def as_tensor(self, payload: memoryview) -> torch.Tensor:
        """A flat page tensor over ``payload`` (no copy; read only)."""
        with warnings.catch_warnings():  # the arena's views are read-only; nothing writes this one
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(payload, dtype=self.page_dtype, count=self.page_elements)
