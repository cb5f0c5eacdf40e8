"""A stand-in for torch.cuda.make_graphed_callables on the CPU (gdn_layer.graphed._capture): the same calling
convention and static-buffer semantics (inputs copied into static tensors, the output and the gradients written
into static buffers and returned as they are, the parameters read live), with the layer run eagerly at each
"replay". Counts the replays."""
import torch


class Replays:
    """The stand-in capture: per layer, static buffers as torch's ``Graphed`` keeps them; counts replays."""

    def __init__(self):
        self.forwards = 0
        self.backwards = 0

    def __call__(self, wrappers, samples):
        return tuple(self._one(w, x0, cu0) for w, (x0, cu0) in zip(wrappers, samples))

    def _one(self, wrapper, x0, cu0):
        params = tuple(wrapper.parameters())
        static_x = x0.detach().clone().requires_grad_(x0.requires_grad)
        static_cu = cu0.clone()
        live = {}
        buffers = {}
        counts = self

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, cu, *ps):
                static_x.data.copy_(x)
                static_cu.copy_(cu)
                with torch.enable_grad():
                    y = wrapper(static_x, static_cu)
                live["y"] = y
                out = buffers.setdefault("y", torch.empty_like(y))
                out.copy_(y.detach())
                counts.forwards += 1
                return out.detach()

            @staticmethod
            def backward(ctx, grad):
                inputs = (static_x,) + tuple(p for p in params if p.requires_grad)
                grads = torch.autograd.grad(live["y"], inputs, grad)
                static = buffers.setdefault("grads", [torch.empty_like(g) for g in grads])
                for s, g in zip(static, grads):
                    s.copy_(g)
                it = iter(static[1:])
                counts.backwards += 1
                return (static[0].detach(), None) + tuple(next(it).detach() if p.requires_grad else None
                                                          for p in params)

        return lambda x, cu: Graphed.apply(x, cu, *params)
