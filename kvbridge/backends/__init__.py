"""Backends: the implementations of every byte kernel, read from a layout's description.

``reference`` (torch, the ground truth), ``native`` (CPU: numba and the optional C extension) and
``triton_kernels`` (CUDA) share one interface; ``dispatch`` picks one for the tensors' device.
"""
