"""The running log-sum-exp over blocks of logits (online softmax), shared by
`zerojax.losses.linear_cross_entropy` and `zerojax.nn.BlockedEmbed`'s head:
per token a running maximum, the sum of exponentials rescaled to it, and
the target's logit, so that no more than one block of logits is alive."""
import jax
import jax.numpy as jnp


def logits(h, w, live):
  """`h @ w.T` in float32, -inf where the row is not `live`."""
  out = jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return jnp.where(live, out, -jnp.inf)


def running_start(tokens: int) -> tuple:
  """The running `(maximum, sum of exponentials, target logit)` per token
  before any block (`running_add`)."""
  return (jnp.full((tokens,), -jnp.inf, jnp.float32),
          jnp.zeros((tokens,), jnp.float32), jnp.zeros((tokens,), jnp.float32))


def running_add(carry: tuple, logits, hit) -> tuple:
  """`carry` after one block of float32 `logits` `[tokens, rows]` (-inf
  where a row is no word), `hit` marking each token's target: the running
  maximum, the sum of exponentials rescaled to it (online softmax), the
  target's logit."""
  top, total, picked = carry
  new_top = jnp.maximum(top, logits.max(axis=1))
  total = (total * jnp.exp(top - new_top)
           + jnp.exp(logits - new_top[:, None]).sum(axis=1))
  return new_top, total, picked + jnp.where(hit, logits, 0.0).sum(axis=1)


def hit(ids, labels, live):
  """`[tokens, rows]`: where a block's row (word `ids`, `live` if real) is
  the token's label."""
  return (ids[None, :] == labels[:, None]) & live


def running_losses(carry: tuple) -> tuple:
  """`(losses, lse)` per token from the carry after the last block."""
  top, total, picked = carry
  lse = top + jnp.log(total)
  return lse - picked, lse
