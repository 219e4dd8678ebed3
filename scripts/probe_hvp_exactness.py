"""Probe: is a layer-by-layer Hessian-vector product bit for bit the whole model's? (issue 60, sophia)

``optax.contrib.hutchinson_estimator_diag_hessian`` (and ``optax.contrib.sophia``, built on it) computes
``H z`` as ``jax.jvp(jax.grad(obj_fn), (params,), (z,))`` (forward-over-reverse, Pearlmutter 1994) with a
Rademacher ``z`` (Hutchinson 1989; Liu et al. 2023, "Sophia"). StandardTrainer could hand optax the whole
model's loss as ``obj_fn``; ReversibleTrainer would have to compute the same product one layer at a time:
a forward pass carrying each layer's activation tangent (``jax.jvp`` of the layer with its parameter tangent
``z_i``), then a backward pass taking, per layer, the ``jvp`` of its ``vjp`` (cotangent and cotangent
tangent going down), each layer's slice of ``H z`` one program's output. The catalogue's promise is bit for
bit, so this probe compares, on the catalogue's model (2-block `ReversibleTransformerLM`, d_model 32,
T 128, batch 8, float32, highest matmul precision, one CPU device inside ``shard_map`` as the trainers run):

1. the per-layer forward tangents at the head's input against one program of the whole forward's jvp, and
   against the tangent inside the whole model's ``jvp(grad)`` program (output as an auxiliary result);
2. the per-layer gradients (the primal outputs of the same per-layer jvp-of-vjp programs) against the whole
   model's ``jax.grad``;
3. the per-layer ``H z`` against the whole model's ``jvp(grad)``;
4. the head alone: its ``jvp(grad)`` program given the very same (bit-equal) input and input tangent.

Prints, per layer and leaf, how many elements differ. Run: ``PYTHONPATH=. python scripts/probe_hvp_exactness.py``
(about 30 s on 2 CPU cores; ``--blocks N``, ``--d-model N``, ``--seed N`` vary the model and data;
``--plain-forward`` takes the forward tangents by a plain ``jvp`` of each layer, as the first version did;
``--cotangents`` also compares the head's input cotangent and its tangent with the whole model's).

Measured 2026-12 (JAX 0.10.2, optax 0.2.8, XLA:CPU): with the forward tangents taken through each layer's
jvp-of-vjp program (below) and the head's LayerNorm in two passes (``use_fast_variance=False``), (1) against
the whole jvp(grad) program's own tangent, (2), (3) and (4) are bit for bit on every layer and leaf (2 blocks
d_model 32 seeds 0 and 1, 4 blocks, d_model 64 seed 2). The whole *forward's* jvp program is not what the
whole jvp(grad) program computes: 5,704 and 2,586 of the two streams' 32,768 tangent elements differ (2
blocks). A plain jvp forward (``--plain-forward``) matches that forward program instead, and that was all of
the head's difference (4.); with the head's one-pass LayerNorm the top block's ``g.down.kernel`` H z differs
(1,675 of 4,096): the whole program recomputes the head's input-cotangent tangent inside the transposing copy
that feeds that kernel's dot, and that kernel rounds it otherwise (fused multiply-adds) than the head's.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import DATA_AXIS, make_mesh, per_device
from revtrain.trainers.common import example_keys, step_key

B, T = 8, 128
PLAIN_FORWARD = "--plain-forward" in sys.argv  # the forward tangents by a plain jvp of each layer (differ)


def _option(name: str, default: int) -> int:  # --blocks N, --d-model N, --seed N
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = make_mesh(jax.devices()[:1])
    model = ReversibleTransformerLM(T, num_layers=_option("--blocks", 2), d_model=_option("--d-model", 32), num_heads=4,
                                    dropout_rate=0.0)
    layers, n = model.layers, len(model.layers)
    params, states = map(list, zip(*[model.init_layer(i) for i in range(n)]))
    rng = np.random.RandomState(_option("--seed", 0))
    batch = {k: rng.randint(0, 256, (B, T)).astype(np.int32) for k in ("inputs", "targets")}
    skey = step_key(0, 0)
    # the Rademacher vector as optax's Hutchinson estimator draws it (float32 signs of the whole tree)
    z = optax.tree.random_like(jax.random.PRNGKey(3 + _option("--seed", 0)), params, jax.random.rademacher,
                               dtype=jnp.float32)

    def keys(i):
        return example_keys(skey, i, B)

    def body(p, x, i):
        return layers[i].apply(p, states[i], x, keys(i), True)[0]

    def head_loss(p, x, batch):
        loss_sum, stats, _ = layers[-1].loss(p, states[-1], x, batch, keys(n - 1), True)
        return loss_sum / lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)

    def objective(ps, batch):
        x = batch["inputs"]
        for i in range(n - 1):
            x = body(ps[i], x, i)
        return head_loss(ps[-1], x, batch)

    def mapped(fn, specs, out):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out))

    R, D = P(), P(DATA_AXIS)
    # -- the whole model: one program each
    whole_hz = mapped(lambda ps, z, b: lax.psum(jax.jvp(jax.grad(lambda q: objective(q, b)), (per_device(ps),),
                                                        (per_device(z),))[1], DATA_AXIS), (R, R, D), R)(params, z, batch)
    whole_g = mapped(lambda ps, b: lax.psum(jax.grad(lambda q: objective(q, b))(per_device(ps)), DATA_AXIS),
                     (R, D), R)(params, batch)

    def whole_forward(ps, z, b):
        def f(q):
            x = b["inputs"]
            for i in range(n - 1):
                x = body(q[i], x, i)
            return x
        return jax.jvp(f, (per_device(ps),), (per_device(z),))
    whole_x, whole_dx = mapped(whole_forward, (R, R, D), D)(params, z, batch)

    def whole_inside(ps, z, b):  # the head's input and its tangent as the whole model's jvp(grad) program has them
        def obj(q):
            x = b["inputs"]
            for i in range(n - 1):
                x = body(q[i], x, i)
            return head_loss(q[-1], x, b), x
        (_, x), (hz, dx) = jax.jvp(jax.grad(obj, has_aux=True), (per_device(ps),), (per_device(z),))
        return lax.psum(hz, DATA_AXIS), x, dx
    inside_hz, inside_x, inside_dx = mapped(whole_inside, (R, R, D), (R, D, D))(params, z, batch)

    # -- layer by layer: forward with tangents, one program per layer
    xs, dxs, x, dx = [], [], batch["inputs"], None
    for i in range(n - 1):
        xs.append(x)
        dxs.append(dx)
        if dx is None:  # the embedding's integer input has no tangent
            x, dx = mapped(lambda p, x, zi, i=i: jax.jvp(lambda q: body(q, x, i), (per_device(p),), (per_device(zi),)),
                           (R, D, R), D)(params[i], x, z[i])
        elif PLAIN_FORWARD:
            x, dx = mapped(lambda p, x, dx, zi, i=i: jax.jvp(lambda q, y: body(q, y, i), (per_device(p), x),
                                                             (per_device(zi), dx)), (R, D, D, R), D)(params[i], x, dx, z[i])
        else:
            # The tangent as the whole model's jvp(grad) program computes it: through the jvp of the layer's
            # vjp, the parameters' H z slice an output (a zero cotangent given at run time, so XLA cannot fold
            # it away). A plain jvp program (--plain-forward) lets XLA:CPU fuse the attention softmax's tangent
            # reduction, sum(exp * d_logits), with its multiply into one YNNPACK kernel; in the whole program
            # (and here) the product is also used by the backward's second-order terms, is materialised, and
            # reduced on its own: other bits.
            def fwd(p, x, dx, zi, ct, i=i):
                def f(q, y, c):
                    out, pull = jax.vjp(lambda r, s: body(r, s, i), q, y)
                    return out, pull(c)[0]
                (y, _), (dy, h) = jax.jvp(f, (per_device(p), x, ct), (per_device(zi), dx, ct))
                return (y, dy), lax.psum(h, DATA_AXIS)
            zero = jax.tree.map(jnp.zeros_like, x)
            (x, dx), _ = mapped(fwd, (R, D, D, R, D), ((D, D), R))(params[i], x, dx, z[i], zero)

    # the head: jvp of its grad (params and input), one program
    def head(p, x, zi, dx, b):
        (gp, gx), (hp, dgx) = jax.jvp(lambda q, y: jax.grad(head_loss, argnums=(0, 1))(q, y, b),
                                      (per_device(p), x), (per_device(zi), dx))
        return (lax.psum(gp, DATA_AXIS), gx), (lax.psum(hp, DATA_AXIS), dgx)
    (gp, gx), (hp, dgx) = mapped(head, (R, D, R, D, D), ((R, D), (R, D)))(params[-1], x, z[-1], dx, batch)
    hz, grads = [None] * n, [None] * n
    hz[-1], grads[-1] = hp, gp
    head_gx, head_dgx = gx, dgx

    # backward: jvp of each layer's vjp (cotangent and its tangent go down), one program per layer
    for i in range(n - 2, -1, -1):
        if dxs[i] is None:
            def back0(p, x, zi, gy, dgy, i=i):
                pull = lambda q, c: jax.vjp(lambda r: body(r, x, i), q)[1](c)[0]  # noqa: E731
                g, h = jax.jvp(pull, (per_device(p), gy), (per_device(zi), dgy))
                return lax.psum(g, DATA_AXIS), lax.psum(h, DATA_AXIS)
            grads[i], hz[i] = mapped(back0, (R, D, R, D, D), (R, R))(params[i], xs[i], z[i], gx, dgx)
            continue

        def back(p, x, dx, zi, gy, dgy, i=i):
            pull = lambda q, y, c: jax.vjp(lambda r, s: body(r, s, i), q, y)[1](c)  # noqa: E731
            (g, gx), (h, dgx) = jax.jvp(pull, (per_device(p), x, gy), (per_device(zi), dx, dgy))
            return (lax.psum(g, DATA_AXIS), gx), (lax.psum(h, DATA_AXIS), dgx)
        (grads[i], gx), (hz[i], dgx) = mapped(back, (R, D, D, R, D, D), ((R, D), (R, D)))(
            params[i], xs[i], dxs[i], z[i], gx, dgx)

    def differing(a, b):
        return [int(np.sum(np.asarray(u).view(np.uint32) != np.asarray(v).view(np.uint32)))
                for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))]

    def worst(a, b):
        return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v))) / max(float(np.max(np.abs(np.asarray(u)))), 1e-30))
                   for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    print("1. forward tangents at the head's input, differing elements: from the whole forward's jvp program",
          differing((whole_x, whole_dx), (x, dx)), "; inside the whole model's jvp(grad) program",
          differing((inside_x, inside_dx), (x, dx)), "(its H z against the other whole program's:",
          differing(inside_hz, whole_hz), ")")
    for i in range(n):
        print(f"2. layer {i} ({layers[i].name}) gradient, differing elements per leaf:", differing(whole_g[i], grads[i]))
    for i in range(n):
        sizes = [int(np.size(u)) for u in jax.tree.leaves(hz[i])]
        print(f"3. layer {i} ({layers[i].name}) H z, differing elements per leaf:", differing(whole_hz[i], hz[i]),
              "of", sizes, f"(worst relative {worst(whole_hz[i], hz[i]):.1e})")
    print("4. head alone, same input and tangent bit for bit (1.), H z differing:", differing(whole_hz[-1], hz[-1]))
    if "--cotangents" in sys.argv:  # diagnostic: the whole model's cotangent at the head's input, via a zero offset
        def whole_e(ps, z, e, b):
            def obj(q, e):
                x = b["inputs"]
                for i in range(n - 1):
                    x = body(q[i], x, i)
                return head_loss(q[-1], jax.tree.map(jnp.add, x, e), b)
            (_, ge), (hq, he) = jax.jvp(jax.grad(obj, argnums=(0, 1)), (per_device(ps), e),
                                        (per_device(z), jax.tree.map(jnp.zeros_like, e)))
            return lax.psum(hq, DATA_AXIS), ge, he
        e = jax.tree.map(jnp.zeros_like, x)
        ehz, ege, ehe = mapped(whole_e, (R, R, D, D), (R, D, D))(params, z, e, batch)
        print("5. whole with offset: H z vs whole", [differing(ehz[i], whole_hz[i]) for i in range(n)],
              "; head's gx, dgx vs the whole's", differing(head_gx, ege), differing(head_dgx, ehe))


if __name__ == "__main__":
    main()
