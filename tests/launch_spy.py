"""A stand-in for a jitted Triton kernel that records what each launch receives (tests of in-place reads)."""


class LaunchSpy:
    """Stands in for a jitted kernel: records the arguments of each launch, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.kwargs, self.grids = kernel, [], [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append(grid)
            self.launches.append(args)
            self.kwargs.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch
