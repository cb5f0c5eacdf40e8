"""A stand-in for torch.cuda.make_graphed_callables on the CPU (gdn_layer.graphed._capture): the same calling
convention and static-buffer semantics (inputs copied into static tensors, the output and the gradients written
into static buffers and returned as they are, the parameters read live), with the layer run eagerly at each
"replay". Counts the replays.

It also models the one memory pool that the real captures share. The forwards were captured in order 0..N-1,
then the backwards in order N-1..0, so the activations that forward i saves for its backward (S_i) live in the
pool from capture fwd_i to capture bwd_i: the temporaries of any capture made outside that span (fwd_k and bwd_k
with k < i) may lie in S_i's memory. So a replay of fwd_k or bwd_k (k < i) clobbers S_i; fwd_i rewrites it; bwd_i
clobbers it too (the backward capture freed S_i as it went). A backward replay of a clobbered S_i returns NaN
gradients, as the real replay would return garbage.

Like the real graphs, a "replay" reads the memory of the parameters captured (detached aliases, so the
parameters' own gradient hooks do not run inside it) and saves nothing through autograd."""
import torch


class Replays:
    """The stand-in capture: per layer, static buffers as torch's ``Graphed`` keeps them; counts replays."""

    def __init__(self):
        self.forwards = 0
        self.backwards = 0
        self.clobbered: set[int] = set()

    def __call__(self, wrappers, samples):
        self.count = len(wrappers)
        return tuple(self._one(i, w, x0, cu0) for i, (w, (x0, cu0)) in enumerate(zip(wrappers, samples)))

    def _replayed(self, index):
        """A replay of capture ``index`` (forward or backward) may overwrite S_k for every k > index."""
        self.clobbered |= set(range(index + 1, self.count))

    def _one(self, index, wrapper, x0, cu0):
        names = [n for n, _ in wrapper.named_parameters()]
        params = tuple(wrapper.parameters())
        static_x = x0.detach().clone().requires_grad_(x0.requires_grad)
        static_cu = cu0.clone()
        live = {}
        buffers = {}
        pool = self

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, cu, *ps):
                static_x.data.copy_(x)
                static_cu.copy_(cu)
                # the layer's own autograd graph stands for the replay's memory: its saved tensors are no
                # business of saved-tensor hooks around the call (activation checkpointing's), as a real
                # replay saves none through autograd
                aliases = [p.detach().requires_grad_(p.requires_grad) for p in params]
                # (a real replay runs captured kernels: the layer, graphed by now, is run as the eager layer)
                entry = wrapper.layer.__dict__.pop("_graphed", None)
                try:
                    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                        y = torch.func.functional_call(wrapper, dict(zip(names, aliases)), (static_x, static_cu))
                finally:
                    if entry is not None:
                        wrapper.layer._graphed = entry
                live["y"], live["params"] = y, aliases
                out = buffers.setdefault("y", torch.empty_like(y))
                out.copy_(y.detach())
                pool.forwards += 1
                pool._replayed(index)
                pool.clobbered.discard(index)
                return out.detach()

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, grad):
                inputs = (static_x,) + tuple(a for a in live["params"] if a.requires_grad)
                grads = torch.autograd.grad(live["y"], inputs, grad, retain_graph=True)
                if index in pool.clobbered:
                    grads = tuple(torch.full_like(g, float("nan")) for g in grads)
                static = buffers.setdefault("grads", [torch.empty_like(g) for g in grads])
                for s, g in zip(static, grads):
                    s.copy_(g)
                it = iter(static[1:])
                pool.backwards += 1
                pool._replayed(index)
                pool.clobbered.add(index)
                return (static[0].detach(), None) + tuple(next(it).detach() if p.requires_grad else None
                                                          for p in params)

        return lambda x, cu: Graphed.apply(x, cu, *params)
