"""The host tier (``ReversibleTrainer.offload = True``): the state in host memory, streamed to the device.

Each layer's weights and optimizer state live as JAX arrays in a host memory kind, in a
`revtrain.tiers.host_store.HostStore` that the streaming engine (`revtrain.streaming`) moves to the device ahead
of each program and back behind it (ZeRO-Offload, Ren et al. 2021, keeps the same state in CPU memory). The
kind is ``unpinned_host`` (pageable) where every device has it, else ``pinned_host``: a GPU's only host kind, in
XLA's pinned pool (`revtrain.pinned`). Kept activations wait in host memory too.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from revtrain import metrics as metrics_lib
from revtrain import pinned
from revtrain.placement import DEVICE_MEMORY, HOST_MEMORY, PAGEABLE_MEMORY, host_memory_supported, replicated
from revtrain.tiers.base import Tier
from revtrain.tiers.host_store import HostStore


class HostTier(Tier):
    """The host tier: the state in host memory, pageable where every device has that space (else pinned), in
    a `HostStore` that the engine streams; kept activations in host memory. It logs one line naming the memory
    the state lives in (`memory_line`; on a GPU with the pinned pool's size) when it first places or restores
    a state.

    Args:
      mesh, sharded: see `revtrain.tiers.base.Tier`.
      pageable: False makes the pageable kind unavailable (the test switch; None: `pinned.NO_PAGEABLE_ENV`).
    """

    name = "host"
    gin_value = True
    label = " + offload"
    releases = True
    host_pool = True
    state_memory = "host"
    keeps_on_host = True

    def __init__(self, mesh: Mesh, sharded: bool = False, pageable: bool | None = None):
        super().__init__(mesh, sharded)
        # Pageable where every device has it: only the engine's copies touch it, never a program. A GPU has
        # none: the state is pinned there, in XLA's pinned pool (`revtrain.pinned`). ``pageable=False`` (or
        # REVTRAIN_NO_PAGEABLE_HOST=1) makes the pageable kind unavailable, as on a GPU: the test switch.
        switched = pageable is False or (pageable is None and pinned.pageable_switched_off())
        self._kind = pinned.state_kind(self._platform(), host_memory_supported(mesh, PAGEABLE_MEMORY),
                                       pageable=not switched)
        self.store = HostStore(self._kind, DEVICE_MEMORY)
        self.memory_line = pinned.describe(self._kind, self._platform(), switched=switched)
        self._said = False

    def _platform(self) -> str:
        return next(iter(self.mesh.devices.flat)).platform

    def _say(self) -> None:
        # Once, when the state is first placed or restored (after the memory plan's check: a refusal stays the
        # only line).
        if not self._said:
            self._said = True
            metrics_lib.log(self.memory_line)

    def put_layer(self, index: int, params, opt_state, pspec=None, ospec=None) -> tuple:
        self._say()
        return super().put_layer(index, params, opt_state, pspec, ospec)

    def place_stacked(self, stack, specs) -> object:
        self._say()
        return super().place_stacked(stack, specs)

    def layer_template(self, index: int, shapes, opt_shapes, pspec=None, ospec=None) -> tuple:
        self._say()
        return super().layer_template(index, shapes, opt_shapes, pspec, ospec)

    def refusal(self) -> str | None:
        if not host_memory_supported(self.mesh):
            return "offload needs a backend with a pinned_host memory space"
        return None

    def fetch(self, tree):
        return jax.device_put(tree, replicated(self.mesh, DEVICE_MEMORY))

    def keep(self, x):
        return jax.device_put(x, jax.tree.map(lambda a: a.sharding.with_memory_kind(HOST_MEMORY), x))

    def bring(self, x):
        return jax.device_put(x, jax.tree.map(lambda a: a.sharding.with_memory_kind(DEVICE_MEMORY), x))

    def describe_place(self) -> str:
        return f"host memory ({self._kind})"

    def trainer_label(self, name: str, sharding: str = "") -> str:
        return name + self.label + sharding

    def sample_words(self) -> tuple[str, str]:
        return "from host memory", "copies {} to the device"

    def layers_in_flight(self) -> int:
        """The layer computing, the one being written back and `Store.read_ahead` fetched ahead."""
        return 2 + self.store.read_ahead

