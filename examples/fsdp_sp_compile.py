"""End to end on 4 CPU ranks: meta-device init, FSDP2 (dp = 2) x Ulysses (sp = 2) on a 2-D mesh,
torch.compile of the mixer, 3 training steps, a full state dict saved and reloaded into a fresh model.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=4 examples/fsdp_sp_compile.py
"""
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, StateDictOptions
from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import reduce_sp_grads, shard_sequence
from requires import help_if_asked, require_torchrun

help_if_asked(__doc__)
require_torchrun("fsdp_sp_compile.py",
                 "OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=4 examples/fsdp_sp_compile.py")
dist.init_process_group("gloo")
CKPT = os.path.join(tempfile.gettempdir(), "gdn_fsdp_sp_compile.pt")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
class Net(nn.Module):
    def __init__(self, sp):
        super().__init__()
        self.emb = nn.Linear(16, 64)
        self.mix = GatedDeltaNet(64, 2, 4, 16, 16, sp_group=sp)
        self.head = nn.Linear(64, 1)
    def forward(self, x, cu):
        h = self.emb(x)
        return self.head(h + self.mix(h, cu_seqlens=cu))
torch.manual_seed(0)
with torch.device("meta"):
    model = Net(mesh["sp"])
model.to_empty(device="cpu")
torch.manual_seed(0)
for m in model.modules():
    if hasattr(m, "reset_parameters"): m.reset_parameters()
fully_shard(model.mix, mesh=mesh["dp"]); fully_shard(model, mesh=mesh["dp"])
model.mix.compile(dynamic=True)     # compile the mixer (SP: without fullgraph)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
dp = mesh["dp"].get_local_rank()
for step in range(3):
    g = torch.Generator().manual_seed(100 * step + dp)
    T = 64 + 16 * step
    x = torch.randn(1, T, 16, generator=g)
    cu = torch.tensor([0, 10 + step, 40, T])
    y = model(shard_sequence(x, mesh["sp"]), cu)
    loss = y.square().sum() / T
    loss.backward()
    reduce_sp_grads(model, mesh["sp"])
    opt.step(); opt.zero_grad()
    if dist.get_rank() == 0: print("step", step, float(loss), flush=True)
sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if dist.get_rank() == 0:
    torch.save(sd, CKPT)
dist.barrier()
fresh = Net(mesh["sp"])
fresh.load_state_dict(torch.load(CKPT))
x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(7)); cu = torch.tensor([0, 30, 64])
with torch.no_grad():
    a = fresh(shard_sequence(x, mesh["sp"]), cu)
    b = model(shard_sequence(x, mesh["sp"]), cu)
print(dist.get_rank(), "reload max diff", float((a - b).abs().max()), flush=True)
dist.destroy_process_group()
