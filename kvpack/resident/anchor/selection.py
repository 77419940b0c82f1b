"""AnchorKV's selection maths (§2–3, Eq. 1, 2, 6): anchor positions, assignment and projection onto
anchors, the observation weights and utilities that rank residual candidates, and the top-N choice.
Pure functions of tensors, unit-tested alone; the store (``store.py``) calls them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...attention.scores import mask_unseen_keys_


def select_anchors(votes: torch.Tensor, seq_len: int, n_anchors: int, window: int, rho: float,
                   generator: torch.Generator) -> torch.Tensor:
    """Anchor positions ``[H, k]`` (sorted): window + top-``ρ(k−W)`` by ``votes [H, S−W]`` + random rest.

    All heads at once on the votes' device; the random part draws one permutation per head from the
    (CPU) ``generator``, so the choice does not depend on the device.
    """
    H = votes.shape[0]
    dev = votes.device
    n_extra = n_anchors - window
    n_top = round(rho * n_extra)
    n_prefix = seq_len - window
    top = torch.topk(votes, n_top, dim=1).indices  # [H, n_top]
    rest = torch.ones(H, n_prefix, dtype=torch.bool, device=dev)
    rest.scatter_(1, top, False)
    pool = rest.nonzero()[:, 1].view(H, n_prefix - n_top)  # each head's remaining positions, ascending
    perms = torch.stack([torch.randperm(n_prefix - n_top, generator=generator) for _ in range(H)])
    rand = torch.gather(pool, 1, perms[:, : n_extra - n_top].to(dev))
    window_pos = torch.arange(n_prefix, seq_len, device=dev).expand(H, -1)
    return torch.cat([top, rand, window_pos], dim=1).sort(dim=1).values


UTILITY_BLOCK = 1024  # tokens per block of Eq. 6's [H, m, block] products (1.2 MB at m = 96; 512-2048 measured alike)
ASSIGN_BLOCK_ELEMENTS = 1 << 24  # bound on one [H, tokens, k] block of |cos| (64 MiB in fp32)


def _nearest_with_dot(x: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 1 for ``x [H, n, D]`` onto ``anchors [H, k, D]``: ``(index [H, n], dot [H, n], norm [H, k])``,
    ``dot`` the chosen anchor's ``x · a / ‖a‖`` (what the argmax compared) and ``norm`` each anchor's
    ``‖a‖`` (clamped away from 0).

    ``‖x‖`` is the same for every anchor of a token, so only the anchors are normalised. Tokens go in
    blocks so that the ``[H, block, k]`` scores stay bounded (unblocked, 128K tokens with k = 1024
    anchors would take 4 GiB per copy).
    """
    H, n, _ = x.shape
    norm = anchors.norm(dim=-1).clamp_min(1e-30)
    unit = anchors / norm[..., None]
    block = max(1, ASSIGN_BLOCK_ELEMENTS // (H * anchors.shape[1]))
    index, dot = [], []
    for i in range(0, n, block):
        scores = torch.bmm(x[:, i: i + block], unit.transpose(1, 2))  # [H, block, k]
        best = scores.abs().argmax(dim=-1, keepdim=True)
        index.append(best[..., 0])
        dot.append(scores.gather(-1, best)[..., 0])
    return torch.cat(index, dim=1), torch.cat(dot, dim=1), norm


def nearest_anchor(x: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Eq. 1: index ``[H, n]`` of the anchor with the largest ``|cos|`` to each row of ``x [H, n, D]``."""
    return _nearest_with_dot(x, anchors)[0]


def project_onto_anchors(x: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Eq. 1–2 for ``x [H, n, D]`` onto ``anchors [H, k, D]``: ``(index [H, n], gamma [H, n], residual)``.

    ``γ = ⟨x, a⟩ / ‖a‖²`` is the nearest-anchor score ``⟨x, a⟩ / ‖a‖`` (already computed for Eq. 1)
    over ``‖a‖``; the residual ``x − γ a`` is one fused multiply-subtract.
    """
    D = x.shape[-1]
    index, dot, norm = _nearest_with_dot(x, anchors)
    a = torch.gather(anchors, 1, index[..., None].expand(-1, -1, D))
    gamma = dot / torch.gather(norm, 1, index)
    return index, gamma, torch.addcmul(x, gamma[..., None], a, value=-1.0)


def assign_and_project(x: torch.Tensor, anchor_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Eq. 1–2 for ``x [H, S, D]`` (fp32) and anchor positions ``[H, k]``.

    Returns:
        ``(anchors [H, k, D], index [H, S] long, gamma [H, S], residual [H, S, D])``; anchors are
        their own anchor with γ = 1 and a zero residual (set exactly, whatever ties or rounding say).
    """
    H, S, D = x.shape
    anchors = torch.gather(x, 1, anchor_pos[..., None].expand(-1, -1, D))
    index, gamma, residual = project_onto_anchors(x, anchors)
    index.scatter_(1, anchor_pos, torch.arange(anchor_pos.shape[1], device=x.device)[None].expand(H, -1))
    gamma.scatter_(1, anchor_pos, torch.ones_like(anchor_pos, dtype=gamma.dtype))
    residual.scatter_(1, anchor_pos[..., None].expand(-1, -1, D), torch.zeros_like(anchors))
    return anchors, index, gamma, residual


def observation_weights(q_obs: torch.Tensor, k_post: torch.Tensor, scaling: float, obs_positions: torch.Tensor,
                        key_positions: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weights ``α [H, m, S]`` of the observation queries on the keys.

    Args:
        q_obs: ``[H, m, D]`` observation queries grouped per KV head.
        k_post: ``[H, S, D]`` post-RoPE keys.
        obs_positions: ``[m]`` position of each observation row (causal visibility).
        key_positions: ``[S]`` positions of the keys, ascending (default ``0..S-1``).
        lse: ``[H, m]`` log-sum-exp of each observation row's logits over *all* keys it attended;
            when the keys here are only part of them (a re-compressed segment), α is normalised
            with it. None: the keys here are all the row saw (the prompt).
    """
    S = k_post.shape[1]
    pos = torch.arange(S, device=k_post.device) if key_positions is None else key_positions
    s = mask_unseen_keys_(torch.bmm(q_obs, k_post.transpose(1, 2)).mul_(scaling), pos, obs_positions)
    return torch.softmax(s, dim=-1) if lse is None else s.sub_(lse[..., None]).exp_()


def utilities(q_obs: torch.Tensor, y_obs: torch.Tensor, k_post: torch.Tensor, v: torch.Tensor, key_residual_post,
              value_residual, scaling: float, obs_positions: torch.Tensor, key_positions: torch.Tensor | None = None,
              lse: torch.Tensor | None = None, alpha: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6: ``(u_K, u_V)`` ``[H, S]``.

    Args:
        q_obs, k_post, obs_positions, key_positions, lse: as :func:`observation_weights`.
        y_obs: ``[H, m, D]`` the observation queries' exact outputs.
        v: ``[H, S, D]`` values.
        key_residual_post: ``[H, S, D]`` key residuals rotated to their positions (R_t r_K).
        value_residual: ``[H, S, D]``.
        alpha: the weights, when the caller already has them.
    """
    if alpha is None:
        alpha = observation_weights(q_obs, k_post, scaling, obs_positions, key_positions, lse)
    H, m, S = alpha.shape
    u_k = torch.empty(H, S, dtype=alpha.dtype, device=alpha.device)
    v_sq = v.square().sum(-1)  # [H, S]
    y_sq = y_obs.square().sum(-1)[..., None]  # [H, m, 1]
    y_twice = y_obs * -2.0  # exact: a power of two
    # Token blocks small enough that the [H, m, block] products stay in a core's cache while each is
    # formed once and updated in place (m = group · W rows; whole, they are the compression's largest
    # tensors and every elementwise pass would go to memory).
    for lo in range(0, S, UTILITY_BLOCK):
        hi = min(lo + UTILITY_BLOCK, S)
        a = alpha[..., lo:hi]
        weighted = torch.bmm(q_obs, key_residual_post[:, lo:hi].transpose(1, 2)).mul_(scaling).mul_(a).square_()
        # ‖V_t − y_w‖² = ‖V_t‖² − 2 y_w · V_t + ‖y_w‖², the cross term as one batched multiply-add.
        dist = torch.baddbmm(v_sq[:, None, lo:hi], y_twice, v[:, lo:hi].transpose(1, 2)).add_(y_sq).clamp_min_(0)
        torch.mean(weighted.mul_(dist), dim=1, out=u_k[:, lo:hi])  # (α ds)² ‖V − y‖², mean over rows
    u_v = torch.linalg.vecdot(alpha, alpha, dim=1).div_(m).mul_(value_residual.square().sum(-1))
    return u_k, u_v


def pool_neighbourhood(u: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max of ``u [H, S]`` over a window of ``kernel`` positions (stride 1, same length); ``-inf``
    entries (anchors) stay ``-inf`` and lend nothing to their neighbours."""
    if kernel == 1:
        return u
    finite = torch.isfinite(u)
    x = torch.where(finite, u, torch.zeros_like(u))  # utilities are >= 0: 0 is a neutral floor
    pooled = F.max_pool1d(x[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    return pooled.masked_fill(~finite, float("-inf"))


def top_pooled(u: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[H, S]``: the ``n`` largest finite utilities of the whole layer (all heads pooled)."""
    flat = u.flatten()
    n = min(n, int(torch.isfinite(flat).sum()))
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    if n > 0:
        chosen[torch.topk(flat, n).indices] = True
    return chosen.reshape(u.shape)


def top_per_head(u: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[H, S]``: an equal share of ``n`` per head (the first ``n mod H`` heads one more), each
    head's largest finite utilities (the "per-head residuals" ablation)."""
    H = u.shape[0]
    return torch.stack([top_pooled(u[h:h + 1], n // H + (h < n % H))[0] for h in range(H)])

