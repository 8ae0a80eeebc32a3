"""The values of the small tensors a network reads, kept beside their meta copies.

A meta tensor has a shape and no values, and a few networks read values: HunyuanVideo-1.5's transformer
puts each prompt's real tokens before its padding (``text[text_mask]`` and ``text[~text_mask]``, boolean
indexing, whose result's length is the mask's count of ``True``) and asks ``torch.all(image_embeds == 0)``
to know whether the call has an image. Both read masks and flags the adapter made on the CPU with real
values (plan/conditioning.py), not anything computed from the weights.

``KnownValues`` keeps, for each meta tensor of at most ``LIMIT`` elements computed only from tensors
whose values are known (CPU tensors, and meta tensors it keeps values of), its values: the same operator run
on those values on the CPU. An input moved to meta (``OnMeta``) is the first such operator. With them:

- ``item()`` (``bool(t)`` too) of such a meta tensor is the item of its values;
- a boolean index with known values (``x[mask]``, its backward's ``index_put``) becomes the long indices
  of its ``True`` entries (``mask.nonzero()``, as torch's own indexing does), so the result has the real run's
  shape, whatever ``x`` is.

The values are computed with every mode off: neither counted as FLOPs nor as the call's memory. A value read
from a tensor computed from weights (unknown) still raises, as before: the call is then NOT MEASURED.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

LIMIT = 1 << 16  # elements: masks and flags, not latents (a value kept costs a real CPU operator)
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


class KnownValues(TorchDispatchMode):
    """Values of the small meta tensors computed from known values; ``item()`` and boolean indices read them."""

    def __init__(self):
        super().__init__()
        self.values = WeakIdKeyDictionary()

    def known(self, t) -> bool:
        return not _meta(t) or t in self.values

    def value(self, t):
        """A meta tensor's values (a CPU tensor), anything else as it is; a device argument on meta is the CPU."""
        if _meta(t):
            return self.values[t]
        return torch.device("cpu") if isinstance(t, torch.device) and t.type == "meta" else t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and args[0] in self.values:
            return self.values[args[0]].item()
        if func in INDEXING:
            indices = [i for index in args[1] for i in _spliced(self._long_indices(index))]
            args = (args[0], indices, *args[2:])
        out = func(*args, **kwargs)
        # most operators make a large tensor or read a weight: they are passed over at the first look
        outputs = [out] if isinstance(out, torch.Tensor) else [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        outputs = [t for t in outputs if t.device.type == "meta"]
        if not outputs:
            return out
        if all(t.numel() <= LIMIT for t in outputs) and self._all_known(args, kwargs):
            with _disable_current_modes():
                computed = func(*tree_map(self.value, args), **tree_map(self.value, kwargs))
            for meta, value in zip(outputs, [t for t in tree_leaves(computed) if isinstance(t, torch.Tensor)]):
                self.values[meta] = value
        elif func._schema.is_mutable:  # an in-place operator with an unknown input leaves its output's values unknown
            for t in outputs:
                self.values.pop(t, None)
        return out

    def _all_known(self, args, kwargs) -> bool:
        for arg in (*args, *kwargs.values()):
            for t in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                if isinstance(t, torch.Tensor) and not self.known(t):
                    return False
        return True

    def _long_indices(self, index):
        """A boolean index with known values as the long indices of its ``True`` entries, one per dimension it
        spans (a tuple, spliced into the index list), on meta and known; any other index as it is."""
        if not (_meta(index) and index.dtype == torch.bool and index in self.values):
            return index
        with _disable_current_modes():
            longs = self.values[index].nonzero().unbind(1)
            metas = tuple(i.to("meta") for i in longs)
        for meta, value in zip(metas, longs):
            self.values[meta] = value
        return metas


def _spliced(index) -> tuple:
    return index if isinstance(index, tuple) else (index,)
