"""``copy.deepcopy`` of a proxy: the host copies the tensor, the app gets a new proxy.

``torch.Tensor.__deepcopy__`` downloads a subclass's storage and then deep-copies the instance's
``__dict__``, which holds the proxy's ``Handle`` and through it the session and its socket:
``TypeError: cannot pickle 'socket' object`` (Ultralytics' ``predict()`` deep-copies the model,
and so does every EMA or "keep a copy of the model" loop). A deep copy must be a tensor of its
own on the host (an in-place edit of one, an EMA update say, must not change the other), so the
copy is one operator, ``aten.clone``, run where the data is: nothing but the operator crosses
the wire, and a copied module stays offloaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def deepcopy_proxy(self: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
    """``RemoteTensor.__deepcopy__``: a host-side clone, a parameter if ``self`` is one."""
    if id(self) in memo:
        return memo[id(self)]
    with torch.no_grad():
        new = torch.ops.aten.clone.default(self)
    if isinstance(self, nn.Parameter):
        new = nn.Parameter(new, requires_grad=self.requires_grad)
    elif self.requires_grad:
        new.requires_grad_(True)
    memo[id(self)] = new
    return new
