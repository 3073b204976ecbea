"""
Torch's intra-op threads and small policies on CPU.

PyTorch starts as many intra-op threads as there are cores. For the small MLPs of classic-control and MuJoCo
policies, the work of one forward/backward pass is far too small to split, and the threads mostly wait for each
other, or, when other jobs share the cores, for the scheduler: ``benchmarks/results/torch_threads_small_mlp.md``
measures the effect on a KLPPO CartPole run. sb3-kl therefore tells the user once per process when an algorithm is
about to train a small policy on CPU with more than one thread, and the zoo wrapper uses one thread unless told
otherwise (:func:`sb3_kl.zoo.registry.with_default_threads`).
"""

import os

import torch as th

from sb3_kl.common.user_warnings import warn_at_user_frame

#: Policies with fewer parameters than this count as small (an MLP of two 256-unit layers for actor and critic has
#: about 140k; SB3's NatureCNN alone has about 1.7M)
SMALL_POLICY_PARAMETERS = 500_000
#: Environment variables through which a user chooses the number of threads: when one is set, no warning
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_warned = False


def warn_if_many_threads(policy: th.nn.Module, device: th.device) -> bool:
    """
    Warn (once per process) when torch uses more than one intra-op thread to train a small policy on CPU, unless the
    number of threads was chosen through ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``.

    :param policy: The policy about to be trained
    :param device: Its device
    :return: whether the warning was issued by this call
    """
    global _warned
    if _warned or device.type != "cpu" or any(os.environ.get(name) for name in THREAD_ENV_VARS):
        return False
    n_threads = th.get_num_threads()
    if n_threads <= 1:
        return False
    n_parameters = sum(p.numel() for p in policy.parameters())
    if n_parameters >= SMALL_POLICY_PARAMETERS:
        return False
    _warned = True
    warn_at_user_frame(
        f"torch uses {n_threads} intra-op threads to train a policy of {n_parameters:,} parameters on CPU: small "
        "policies train faster on one thread, many times faster when other jobs share the cores "
        "(benchmarks/results/torch_threads_small_mlp.md). Call torch.set_num_threads(1) before training (or set "
        "OMP_NUM_THREADS, which also silences this warning, to the number of threads you want)."
    )
    return True
