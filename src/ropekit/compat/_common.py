"""What the compat modules share: errors in the peer's argument names, and in-place rotation with autograd."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ropekit.backends import BACKENDS

__all__ = ["check_backend_name", "in_place", "peer_names", "renamed"]


@contextlib.contextmanager
def peer_names(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise the core's ValueErrors under the caller's argument names (offsets -> seqlen_offsets, ...).

    The core's messages start with the argument they are about ("offsets: expected ..."); a caller of a peer's
    API never typed that name, so the prefix is swapped for the one they did type.
    """
    try:
        yield
    except ValueError as err:
        raise renamed(err, names) from None


def renamed(err: ValueError, names: Mapping[str, str], *, within: bool = False) -> ValueError:
    """err under the caller's argument name (see :func:`peer_names`), or err itself if it names none of them.

    ``within=True`` renames the arguments the message goes on to name too ("shares memory with cos" ->
    "... with cos_sin_cache", "pass q.clone()" -> "pass query.clone()"): each name standing alone, not a part
    of another word or of "cos/sin". For hot paths, where a ``with peer_names(...)`` block costs more than the
    call it guards.
    """
    name, sep, rest = str(err).partition(":")
    body = rest
    if within:
        pattern = r"(?<![\w/-])(" + "|".join(map(re.escape, names)) + r")(?![\w/-])"
        body = re.sub(pattern, lambda m: names[m.group(1)], rest)
    if sep and (name in names or body != rest):
        return type(err)(f"{names.get(name, name)}:{body}")  # the same class (InPlaceError is a RuntimeError)
    return err


class _InPlaceRotation(torch.autograd.Function):
    """A tensor rotated in place and returned, as flash-attn's in-place Functions do.

    The backward pass is the same rotation by -theta (``rotate(grad, True)``) of a copy of the incoming
    gradient, which is never written to. A non-leaf input is marked dirty, so autograd rebases its history
    like any in-place op. A leaf that requires grad (or a view of one) cannot be marked dirty: PyTorch forbids
    in-place writes there. As in flash-attn, the rotated leaf is then returned as a new view whose grad_fn is
    this rotation, and the leaf's own ``.grad`` receives the gradient through it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rotate: Callable[[torch.Tensor, bool], None]) -> torch.Tensor:
        rotate(x, False)
        ctx.rotate = rotate
        base = x if x._base is None else x._base
        if not (base.is_leaf and base.requires_grad):
            ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        ctx.rotate(grad, True)
        return grad, None


def in_place(x: torch.Tensor, rotate: Callable[[torch.Tensor, bool], None]) -> torch.Tensor:
    """Call ``rotate(x, False)``, which writes into x, and return x, recorded for autograd if needed.

    ``rotate(t, conjugate)`` must rotate the right parts of any tensor shaped like x (by -theta if conjugate).
    """
    if isinstance(x, torch.Tensor) and torch.is_grad_enabled() and x.requires_grad:
        return _InPlaceRotation.apply(x, rotate)
    rotate(x, False)
    return x


def check_backend_name(backend: object) -> str:
    """A compat module's ``backend=`` at construction: a name the core's dispatch knows."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    return backend
