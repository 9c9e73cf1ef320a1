import torch.distributed as dist
from tests import test_parity as tp

def body():
    m = tp.new_model()
    tp.fit(m, tp.make_strategy("fsdp"), dist.get_world_size(), 2)
    w = m.blocks[0].l1.weight
    return tuple(w.shape), w.untyped_storage().nbytes(), float(w.detach().clone().sum())
