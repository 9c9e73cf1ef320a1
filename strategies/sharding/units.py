"""Which parameters go in which unit: buckets for replicated parameters, wrapped modules for fsdp."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

BUCKET_ELEMENTS = 25 * 1024 * 1024 // 4  # like torch DDP's 25 MiB buckets, in fp32 elements

NamedParams = list[tuple[str, nn.Parameter]]
NORM_LAYERS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def full_precision_norm_units(root: nn.Module, chosen: set[str]) -> set[str]:
    """Under mixed precision, the normalization layers not already chosen as units become units of their own, kept
    in full precision (layer statistics are fragile in bf16/fp16)."""
    return {name for name, m in root.named_modules() if name and isinstance(m, NORM_LAYERS)} - chosen


def unique_named_parameters(root: nn.Module) -> NamedParams:
    """Each parameter once, under the first name it is registered with (tied weights share one entry)."""
    return list(root.named_parameters())


def gradient_buckets(root: nn.Module, bucket_elements: int = BUCKET_ELEMENTS) -> list[NamedParams]:
    """Parameters in reverse registration order (roughly the order backward produces their gradients), cut into
    buckets of at most `bucket_elements` of one dtype, device and kind: frozen parameters get buckets of their own,
    which are never reduced, so each trainable bucket is split evenly over the ranks (layout.py)."""
    buckets: list[NamedParams] = []
    filling: dict[tuple, tuple[NamedParams, int]] = {}  # by kind: the bucket being filled and its size
    for name, p in reversed(unique_named_parameters(root)):
        kind = (p.dtype, p.device, p.requires_grad)
        current, size = filling.get(kind, ([], 0))
        if current and size + p.numel() > bucket_elements:
            buckets.append(current)
            current, size = [], 0
        filling[kind] = (current + [(name, p)], size + p.numel())
    buckets += [bucket for bucket, _ in filling.values()]
    order = {id(p): i for i, (_, p) in enumerate(reversed(unique_named_parameters(root)))}
    return sorted(buckets, key=lambda bucket: order[id(bucket[0][1])])


def policy_modules(
    root: nn.Module, policy: Callable[[nn.Module, str], bool] | None
) -> list[tuple[str, nn.Module]]:
    """Modules the policy makes units, in registration order, plus modules marked by hand; never the root."""
    chosen = []
    for name, module in root.named_modules():
        if not name:
            continue
        if getattr(module, "_shard_unit", False) or (policy is not None and policy(module, name)):
            chosen.append((name, module))
    return chosen


def _ancestors(unit_names: list[str], module_name: str) -> list[str]:
    """Unit names that contain `module_name` (the root, "", contains everything), shallowest first."""
    return [u for u in unit_names if u == "" or module_name == u or module_name.startswith(u + ".")]


def assign_to_units(root: nn.Module, unit_names: list[str]) -> dict[str, NamedParams]:
    """Each parameter goes to the deepest unit that contains every module using it, so a tied parameter
    (an embedding shared with the output head, say) lives in one unit that is gathered for both uses."""
    unit_names = [""] + sorted(unit_names, key=lambda n: n.count(".") + 1 if n else 0)
    holders: dict[int, list[str]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(module_name)
    assigned: dict[str, NamedParams] = {name: [] for name in unit_names}
    for name, p in unique_named_parameters(root):
        common = set(unit_names)
        for holder in holders[id(p)]:
            common &= set(_ancestors(unit_names, holder))
        owner = max(common, key=lambda n: (n.count(".") + 1 if n else 0, len(n)))
        assigned[owner].append((name, p))
    return assigned


def mark_as_unit(module: nn.Module) -> nn.Module:
    """Make `module` an FSDP unit by hand, whatever the `auto_wrap_policy` says (call it in `configure_model`).

    Args:
        module: a submodule of the model (the model itself is always the last unit).

    Returns:
        `module`, marked.
    """
    module._shard_unit = True
    return module
