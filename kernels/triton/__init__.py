"""Our own Triton kernels for the GatedDeltaNet data path around the chunk kernel.

One file per operation (forward kernel, backward kernel, launchers, autograd): ``gate.py`` (``g``, ``beta``),
``norm.py`` (gated RMSNorm), ``l2norm.py`` (q / k L2 norm); the conv (varlen causal conv1d + SiLU with conv
states) in ``conv.py`` (launchers, their tuning, autograd), ``conv_fwd_kernels.py``, ``conv_bwd_kernels.py``,
``conv_tiles.py`` (the kernels' shared helpers) and ``conv_args.py`` (the launchers' argument preparation);
``decode.py`` one decode step from a state pool (conv update, then gate, q / k L2 norm and the delta-rule
step, pool rows read and written in place; forward only); ``_math.py`` holds the portable elementwise helpers they share (sigmoid, softplus, bf16 rounding),
``_grid.py`` the launch-size cap (at most 65 535 programs per launch: persistent programs loop over
their tiles).
Every length- or count-derived argument is a runtime argument (``do_not_specialize``), never a
``tl.constexpr`` or an autotune key, so a new packed layout compiles nothing; block sizes depend on
channel / head dims only. They run under ``TRITON_INTERPRET=1`` (the CPU tests) and use no
CUDA-only intrinsics (they carry to triton-ascend).
"""
