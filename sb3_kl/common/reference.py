"""
Reference-policy KL: anchor a policy to a trusted, frozen one while it learns a new reward.

The algorithms add ``beta_ref * KL_ref`` to what they optimize, where ``KL_ref`` is the per-state KL between the
current policy and a frozen reference policy on the rollout states, by default ``KL(pi_theta || pi_ref)`` (the
direction RLHF uses: the policy pays for putting probability where the reference puts little).

This module holds what the algorithms share for it:

- loading a reference from a saved SB3 model (any on-policy algorithm's zip), a model or a policy, into a frozen
  copy (:func:`load_reference_policy`), whose skeleton is rebuilt from plain constructor information when a model is
  loaded (:mod:`sb3_kl.common.policy_copy`), so that ``load`` restores the anchor from the model's own zip;
- :class:`ReferenceKLMixin`: the options, the KL term used inside the losses, its coefficient controller
  (the same classes as the update KL's, with its own state) and the measurement and logs after each update.
"""

import copy
import math
import os
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.distributions import Distribution
from stable_baselines3.common.policies import ActorCriticPolicy, BasePolicy
from stable_baselines3.common.save_util import load_from_zip_file
from stable_baselines3.common.type_aliases import PyTorchObs

from sb3_kl.common.callbacks_monitor import distribution_params_for_policy
from sb3_kl.common.controllers import (
    KL_CONTROLLERS,
    FixedKLController,
    KLController,
    make_kl_controller,
    warn_ignored_arguments,
)
from sb3_kl.common.kl import (
    KL_DIRECTIONS,
    KL_ESTIMATORS,
    DistributionParams,
    KLSettings,
    as_float64,
    check_choice,
    kl_quantiles,
    per_state_importance_sampled_kl,
    per_state_kl,
    per_state_kl_to,
)
from sb3_kl.common.modes import acting_mode
from sb3_kl.common.policy_copy import (
    ACTOR_CRITIC_POLICIES,
    build_reference_policy,
    is_frozen_reference,
    reference_spec,
)
from sb3_kl.common.recurrent import is_recurrent_policy
from sb3_kl.common.user_warnings import warn_at_user_frame
from sb3_kl.common.validation import check_existing_file, check_pair, check_positive, is_number

#: Reference options that ``load()`` takes out of its arguments and applies or refuses once the model is loaded
#: (:meth:`ReferenceKLMixin._apply_loaded_reference_options`)
LOADED_REFERENCE_OPTIONS = ("ref_policy", "ref_target_kl")
#: How ``ref_target_kl``'s errors say what None means
REF_TARGET_KL_HINT = " (None: a fixed coefficient)"

ReferenceSource = str | os.PathLike | BaseAlgorithm | BasePolicy


def _policy_from_zip(path: str | os.PathLike, device: th.device | str) -> ActorCriticPolicy:
    """
    Rebuild the policy of a saved SB3 model from its zip, whatever algorithm saved it (PPO, A2C, TRPO, KLPPO, ...):
    the policy class, spaces and ``policy_kwargs`` are read from the zip's data, the weights from ``policy.pth``.
    """
    data, params, _ = load_from_zip_file(path, device=device, print_system_info=False)
    if data is None or params is None or "policy" not in params:
        raise ValueError(f"`ref_policy`={os.fspath(path)!r} is not a saved SB3 model with a policy (no data or policy.pth).")
    policy_class = data.get("policy_class")
    if not (isinstance(policy_class, type) and issubclass(policy_class, ACTOR_CRITIC_POLICIES)):
        raise ValueError(
            f"`ref_policy`={os.fspath(path)!r} holds a {getattr(policy_class, '__name__', policy_class)!r} policy: the "
            "reference must be an ActorCriticPolicy (a model saved by PPO, A2C, TRPO, KLPPO, ClipKLPPO or KLTRPO) or a "
            "MaskableActorCriticPolicy (MaskablePPO, MaskableKLPPO)."
        )
    kwargs = dict(data.get("policy_kwargs") or {})
    if issubclass(policy_class, ActorCriticPolicy):  # (maskable policies take no use_sde)
        # On-policy algorithms pass use_sde to the policy outside policy_kwargs
        kwargs.setdefault("use_sde", bool(data.get("use_sde", False)))
    kwargs.update(observation_space=data["observation_space"], action_space=data["action_space"])
    policy = build_reference_policy(policy_class, kwargs, device)
    policy.load_state_dict(params["policy"])
    return policy


def load_reference_policy(source: ReferenceSource, device: th.device | str = "cpu") -> ActorCriticPolicy:
    """
    A frozen copy of the reference policy. The source is never modified (a model or policy passed in keeps training
    normally).

    :param source: Path of a saved SB3 model (``.zip``), an SB3 model, or an ``ActorCriticPolicy``
    :param device: Device of the copy
    :return: The frozen reference policy (eval mode, ``requires_grad=False``, no optimizer)
    """
    if isinstance(source, (str, os.PathLike)):
        return _policy_from_zip(source, device)
    policy = source.policy if isinstance(source, BaseAlgorithm) else source
    if not isinstance(policy, ACTOR_CRITIC_POLICIES):
        raise TypeError(
            f"`ref_policy` must be the path of a saved SB3 model, an SB3 on-policy model or an ActorCriticPolicy, "
            f"got {type(source).__name__}."
        )
    policy_class, kwargs = reference_spec(policy)
    frozen = build_reference_policy(policy_class, kwargs, device)
    frozen.load_state_dict(copy.deepcopy(policy.state_dict()))
    return frozen


def same_weights(first: th.nn.Module, second: th.nn.Module) -> bool:
    """Whether two modules hold the same parameters and buffers (same names, shapes and values)."""
    a, b = first.state_dict(), second.state_dict()
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and th.equal(a[k].cpu(), b[k].cpu()) for k in a)


def check_reference_spaces(reference: ActorCriticPolicy, observation_space: spaces.Space, action_space: spaces.Space) -> None:
    """
    :raises ValueError: when the reference was trained on another action or observation space
    """
    if reference.action_space != action_space:
        raise ValueError(
            f"`ref_policy` acts in {reference.action_space}, but this model's action space is {action_space}: "
            "the KL to a reference is only defined on the same action space. Pass a reference trained on this action space."
        )
    if reference.observation_space != observation_space:
        raise ValueError(
            f"`ref_policy` observes {reference.observation_space}, but this model's observation space is "
            f"{observation_space}: pass a reference trained on the same observations (same wrappers)."
        )


def _given_reference_options(**options: tuple[Any, Any]) -> list[str]:
    """:return: the options of ``name=(value, default)`` whose value is not their default, as ``name=value``"""
    return [f"`{name}`={value!r}" for name, (value, default) in options.items() if value != default]


class ReferenceKLMixin:
    """
    Reference-policy KL for :class:`~sb3_kl.common.on_policy_algorithm.KLOnPolicyAlgorithm`.

    The options are stored by :meth:`_init_reference` (from ``__init__``), the frozen reference is built by
    :meth:`_setup_reference` (from ``_setup_model``, also during ``load``). Persistence follows SB3's pattern:
    ``ref_policy`` (a module) is excluded from the pickled data and its weights are saved as ``ref_policy.pth``
    through ``_get_torch_save_params``; its class and constructor arguments are plain attributes
    (``ref_policy_class``, ``ref_policy_kwargs``), so ``load`` rebuilds the skeleton in ``_setup_model`` before
    ``set_parameters`` fills it: the anchor is restored from the model's own zip even if the original file is gone.
    """

    ref_policy: ActorCriticPolicy | None
    ref_kl_controller: KLController | None
    ref_kl_settings: KLSettings
    ref_target_kl: float | None
    ref_policy_class: type[ActorCriticPolicy] | None
    ref_policy_kwargs: dict[str, Any] | None
    ref_dist_params: DistributionParams | None
    #: the reference is a skeleton that ``load()`` rebuilt, whose saved weights ``set_parameters`` loads next
    _reference_awaits_weights: bool

    def _init_reference(
        self,
        ref_policy: ReferenceSource | None,
        ref_kl_coef: float,
        ref_target_kl: float | None,
        ref_kl_controller: str | KLController,
        ref_kl_direction: str,
        ref_kl_estimator: str,
        ref_kl_coef_bounds: tuple[float, float],
        kl_reduction: str,
        log_ratio_clip: float,
    ) -> None:
        """Validate and store the reference options (the reference itself is loaded in ``_setup_model``)."""
        check_choice("ref_kl_direction", ref_kl_direction, KL_DIRECTIONS)
        check_choice("ref_kl_estimator", ref_kl_estimator, KL_ESTIMATORS)
        # Checked even when unused (ref_target_kl=None or no ref_policy), so a typo does not wait for a later change
        if not isinstance(ref_kl_controller, KLController):
            check_choice("ref_kl_controller", ref_kl_controller, tuple(KL_CONTROLLERS))
        ref_kl_coef_bounds = check_pair("ref_kl_coef_bounds", ref_kl_coef_bounds)
        if isinstance(ref_policy, (str, os.PathLike)):
            check_existing_file("ref_policy", ref_policy, suffix=".zip")  # SB3's load adds a missing .zip
        self.ref_kl_settings = KLSettings(ref_kl_estimator, ref_kl_direction, kl_reduction, log_ratio_clip)
        if not is_number(ref_kl_coef) or not math.isfinite(ref_kl_coef):
            raise ValueError(f"`ref_kl_coef` must be a finite number >= 0, got {ref_kl_coef!r}.")
        ref_target_kl = check_positive("ref_target_kl", ref_target_kl, allow_none=True, hint=REF_TARGET_KL_HINT)
        if ref_kl_coef < 0:
            raise ValueError(
                f"`ref_kl_coef` must be >= 0 (0 with ref_target_kl=None only measures the KL), got {ref_kl_coef!r}."
            )
        if ref_kl_coef == 0 and (ref_target_kl is not None or isinstance(ref_kl_controller, KLController)):
            raise ValueError(
                "`ref_kl_coef`=0 only measures the KL to the reference: a controller cannot adapt it, pass ref_kl_coef > 0."
            )
        if ref_kl_coef > 0 and not isinstance(ref_kl_controller, KLController):
            low, high = ref_kl_coef_bounds
            if not low <= ref_kl_coef <= high:
                raise ValueError(
                    f"`ref_kl_coef`={ref_kl_coef!r} lies outside `ref_kl_coef_bounds`={tuple(ref_kl_coef_bounds)}: "
                    "pass a coefficient within the bounds, or widen them."
                )
        if ref_policy is None:
            unused = _given_reference_options(
                ref_kl_coef=(ref_kl_coef, 1.0),
                ref_target_kl=(ref_target_kl, None),
                ref_kl_controller=(ref_kl_controller, "adaptive"),
                ref_kl_coef_bounds=(tuple(ref_kl_coef_bounds), (1e-4, 10.0)),
                ref_kl_direction=(ref_kl_direction, "reverse"),
                ref_kl_estimator=(ref_kl_estimator, "analytic"),
            )
            if unused:
                warn_at_user_frame(
                    f"{', '.join(unused)} set without `ref_policy`: there is no reference to anchor to, so "
                    f"{'it is' if len(unused) == 1 else 'they are'} ignored. Pass ref_policy= (a saved model, a model "
                    "or a policy) to anchor the policy to it."
                )
        self.ref_target_kl = ref_target_kl
        controller: KLController | None
        if isinstance(ref_kl_controller, KLController):
            controller = ref_kl_controller
            warn_ignored_arguments(
                "ref_kl_controller",
                controller,
                ref_kl_coef=(ref_kl_coef, 1.0),
                ref_kl_coef_bounds=(tuple(ref_kl_coef_bounds), (1e-4, 10.0)),
            )
        elif ref_kl_coef == 0:
            controller = None  # measure only
        elif ref_target_kl is None:
            controller = FixedKLController(float(ref_kl_coef), ref_kl_coef_bounds)
        else:
            controller = make_kl_controller(ref_kl_controller, float(ref_kl_coef), kl_coef_bounds=ref_kl_coef_bounds)
        self.ref_kl_controller = controller
        if ref_policy is not None and not isinstance(ref_policy, (str, os.PathLike, BaseAlgorithm, BasePolicy)):
            raise TypeError(
                f"`ref_policy` must be the path of a saved SB3 model, an SB3 on-policy model or an ActorCriticPolicy, "
                f"got {type(ref_policy).__name__}."
            )
        # Raw source until _setup_model turns it into the frozen copy
        self.ref_policy = ref_policy  # type: ignore[assignment]
        self.ref_policy_class = None
        self.ref_policy_kwargs = None
        self.ref_dist_params = None

    def _apply_loaded_reference_options(self, options: dict[str, Any]) -> None:
        """
        Apply, or refuse, the reference options given to ``load()`` (:data:`LOADED_REFERENCE_OPTIONS`), once the
        model is loaded: SB3's ``load`` would set them as plain attributes, where the saved reference (restored from
        the zip's ``ref_policy.pth``) and controller would silently override or ignore them.

        - ``ref_target_kl``: checked as in the constructor and applied; a target for a model built with a fixed
          coefficient (``ref_target_kl=None``) needs an adapting controller passed as well (``ref_kl_controller=``
          a controller object, which replaces the saved one).
        - ``ref_policy``: the reference is the saved one; the same policy (same weights) is accepted, another refused.

        :param options: The options taken from ``load()``'s arguments
        :raises ValueError: for an option ``load()`` cannot apply, naming it and the fix
        """
        if "ref_target_kl" in options:
            target = check_positive("ref_target_kl", options["ref_target_kl"], allow_none=True, hint=REF_TARGET_KL_HINT)
            controller = self.ref_kl_controller
            if target is not None and target != self.ref_target_kl:
                if controller is None or isinstance(controller, FixedKLController):
                    if controller is None:
                        built = "ref_kl_coef=0 (the KL to the reference only measured)"
                    elif self.ref_target_kl is None:
                        built = "ref_target_kl=None (a fixed reference coefficient)"
                    else:
                        built = "ref_kl_controller='fixed' (a fixed reference coefficient)"

                    raise ValueError(
                        f"`ref_target_kl`={target!r} cannot be applied by load(): the model was built with {built}, "
                        "which no target adapts; pass an adapting controller as well (ref_kl_controller="
                        "AdaptiveKLController(...) from sb3_kl.common.controllers, which replaces the saved one), or "
                        "build a new model with ref_target_kl."
                    )
            self.ref_target_kl = target
        if "ref_policy" in options:
            source, restored = options["ref_policy"], self.ref_policy
            if source is None and restored is None:
                return
            same = (
                source is not None
                and restored is not None
                and same_weights(load_reference_policy(source, self.device), restored)  # type: ignore[attr-defined]
            )
            if not same:
                saved = "no reference" if restored is None else "its reference, restored from the saved zip"
                raise ValueError(
                    f"`ref_policy` cannot be replaced by load(): the model was saved with {saved}. To anchor a trained "
                    "model to another reference, build a new model with ref_policy=... and load the trained weights "
                    "into it with set_parameters(path)."
                )

    @property
    def ref_kl_coef(self) -> float:
        """The current coefficient beta_ref of the reference KL (0 when it is only measured)."""
        return 0.0 if self.ref_kl_controller is None else self.ref_kl_controller.kl_coef

    def _setup_reference(self) -> None:
        """
        Turn the ``ref_policy`` source into the frozen copy (or, during ``load``, rebuild its skeleton from
        ``ref_policy_class``/``ref_policy_kwargs``; ``set_parameters`` loads the weights next), and check it matches
        this model's spaces and action distribution. Idempotent.
        """
        # ``Algo.load(path, ref_kl_coef=x)`` puts it in ``__dict__`` (shadowed by the property): apply it
        if "ref_kl_coef" in self.__dict__:
            value = float(self.__dict__.pop("ref_kl_coef"))
            if self.ref_kl_controller is None or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"`ref_kl_coef`={value!r} can only override a positive coefficient of a model with a reference."
                )
            low, high = self.ref_kl_controller.kl_coef_bounds
            if not low <= value <= high:
                raise ValueError(
                    f"`ref_kl_coef`={value!r} lies outside `ref_kl_coef_bounds`={(low, high)}: pass a value within "
                    "them, or a `ref_kl_controller` with wider bounds as another keyword of `load`."
                )
            self.ref_kl_controller.kl_coef = value
        source = self.ref_policy
        device = self.device  # type: ignore[attr-defined]
        if source is None and self.ref_policy_class is None:
            self._reference_awaits_weights = False
            return
        # Building the reference draws its initial weights from torch's global generator: on a fork of it, so
        # that a model with a reference samples the same actions as one without (same seed, ref_kl_coef=0)
        with th.random.fork_rng(devices=[]):
            if source is None:
                # load(): the weights follow from ref_policy.pth (set_parameters loads them into this skeleton only)
                reference = build_reference_policy(self.ref_policy_class, self.ref_policy_kwargs or {}, device)
                self._reference_awaits_weights = True
            elif is_frozen_reference(source):  # already set up (a skeleton still awaits its weights)
                reference = source.to(device)  # type: ignore[union-attr]
            else:
                self._reference_awaits_weights = False
                if isinstance(source, (BaseAlgorithm, BasePolicy)):
                    # before copying it: a policy that cannot be evaluated on observations alone may not copy cleanly
                    self._check_reference_policy(source.policy if isinstance(source, BaseAlgorithm) else source)
                reference = load_reference_policy(source, device)
        self._check_reference_policy(reference)
        check_reference_spaces(reference, self.observation_space, self.action_space)  # type: ignore[attr-defined]
        ref_layout = distribution_params_for_policy(reference.action_dist)
        own_layout: DistributionParams = self.dist_params  # type: ignore[attr-defined]
        if type(ref_layout) is not type(own_layout) or ref_layout.n_params != own_layout.n_params:
            raise ValueError(
                f"`ref_policy` has a {type(reference.action_dist).__name__} action distribution with {ref_layout.n_params} "
                f"parameters per state, this model's policy a {type(self.policy.action_dist).__name__} with "  # type: ignore[attr-defined]
                f"{own_layout.n_params}: the reference KL needs the same kind of distribution."
            )
        # gSDE with squash_output=True: the KL is taken between the Gaussians before the tanh, which is the KL between
        # the action distributions only when both squash (the same bijection) or neither does
        ref_squash = bool(getattr(reference, "squash_output", False))
        own_squash = bool(getattr(self.policy, "squash_output", False))  # type: ignore[attr-defined]
        if ref_squash != own_squash:
            raise ValueError(
                f"`ref_policy` has squash_output={ref_squash} and this model's policy squash_output={own_squash}: the "
                "KL between a tanh-squashed and an unsquashed Gaussian is not that of their Gaussians before the tanh. "
                f"Pass a reference trained with `policy_kwargs=dict(squash_output={own_squash})` (and `use_sde=True` "
                "when squashing), or build this model with the reference's setting."
            )
        self.ref_policy = reference
        self.ref_policy_class, self.ref_policy_kwargs = reference_spec(reference)
        self.ref_dist_params = ref_layout

    def _check_reference_policy(self, policy: BasePolicy) -> None:
        """
        Refuse a reference this algorithm cannot evaluate. Called at construction (and in ``load``) on the policy
        passed as ``ref_policy`` (or rebuilt from its zip), before anything else uses it. The feed-forward algorithms
        evaluate the reference on the buffer's observations alone, so a recurrent policy (its distribution depends on
        LSTM states the buffer does not hold for it) is refused; a recurrent algorithm that keeps those states
        overrides this method.

        :param policy: The reference policy
        :raises ValueError: for a recurrent reference
        """
        if is_recurrent_policy(policy):
            raise ValueError(
                f"`ref_policy` is a recurrent policy ({type(policy).__name__}, e.g. from sb3-contrib's RecurrentPPO): its "
                f"action distribution depends on LSTM states, which {type(self).__name__} does not keep for the "
                "reference, so the KL to it cannot be computed from the observations alone. Pass a feed-forward "
                "reference (a model saved by PPO, A2C, TRPO, KLPPO, ClipKLPPO or KLTRPO, or its ActorCriticPolicy)."
            )

    # ----------------------------------------------------------------------------------------------------------
    # The term inside the losses

    @th.no_grad()
    def _reference_distribution(
        self, obs: PyTorchObs, actions: th.Tensor | None = None, action_masks: th.Tensor | None = None
    ) -> tuple[th.Tensor, th.Tensor | None]:
        """
        The frozen reference on a batch of states (no gradients; eval mode).

        :param obs: Observations
        :param actions: Stored actions (as used by ``log_prob``); needed only by the sample estimators
        :param action_masks: Action masks of the states (MaskableKLPPO): the reference is masked as the policy is
        :return: the reference's distribution parameters ``(batch, n_params)`` and, with actions and a sample
            estimator, ``log pi_ref(a|s)``
        """
        assert self.ref_policy is not None and self.ref_dist_params is not None
        if action_masks is None:
            distribution = self.ref_policy.get_distribution(obs)
        else:
            distribution = self.ref_policy.get_distribution(obs, action_masks=action_masks)  # type: ignore[call-arg]
        params = self.ref_dist_params.extract(distribution)
        log_prob = None
        if actions is not None and self.ref_kl_settings.estimator != "analytic":
            log_prob = distribution.log_prob(actions)
        return params, log_prob

    def _reference_kl(
        self,
        ref_params: th.Tensor,
        distribution: Distribution | th.Tensor,
        log_prob: th.Tensor | None = None,
        ref_log_prob: th.Tensor | None = None,
        old_log_prob: th.Tensor | None = None,
    ) -> th.Tensor:
        """
        Per-state KL between the current policy and the reference, with the KL core (no second implementation).

        Analytic: the exact KL; the reference takes the "old" slot of the core's convention, so ``"reverse"`` is
        KL(pi || pi_ref) and ``"forward"`` KL(pi_ref || pi). Sample estimators: the stored actions were drawn by the
        rollout policy pi_old, neither by pi nor by pi_ref, so the estimate is importance-weighted to pi_old
        (:func:`~sb3_kl.common.kl.importance_sampled_kl`): ``"reverse"`` ``(pi / pi_old) k(pi_ref / pi)``,
        ``"forward"`` ``(pi_ref / pi_old) k(pi / pi_ref)``. Its expectation over the stored actions is the KL it names
        for every pi, so its expected gradient is that KL's gradient (the weight ``pi / pi_old`` carries the
        score-function part).

        :param ref_params: Reference parameters on the states, ``(batch, n_params)``
        :param distribution: The current policy's live distribution (loss path, gradients flow) or its parameters
        :param log_prob: ``log pi(a|s)`` of the stored actions (sample estimators)
        :param ref_log_prob: ``log pi_ref(a|s)`` of the stored actions (sample estimators)
        :param old_log_prob: ``log pi_old(a|s)`` of the stored actions, from the rollout (sample estimators)
        :return: ``(batch,)``
        """
        settings = self.ref_kl_settings
        layout: DistributionParams = self.dist_params  # type: ignore[attr-defined]
        if settings.estimator == "analytic":
            if isinstance(distribution, th.Tensor):
                return per_state_kl(settings, layout, ref_params, distribution)
            return per_state_kl_to(settings, layout, ref_params, distribution)
        if log_prob is None or ref_log_prob is None or old_log_prob is None:
            raise ValueError(
                f"The {settings.estimator!r} reference-KL estimator needs the log-probabilities of the stored actions "
                "under the current policy, the reference and the rollout policy that drew them."
            )
        return per_state_importance_sampled_kl(settings, layout, log_prob, ref_log_prob, old_log_prob)

    def _reference_penalty(
        self,
        obs: PyTorchObs,
        actions: th.Tensor,
        distribution: Distribution,
        log_prob: th.Tensor,
        old_log_prob: th.Tensor | None = None,
        action_masks: th.Tensor | None = None,
    ) -> th.Tensor:
        """
        Mean reference KL of a minibatch (with gradients through ``distribution``).
        Its expectation over the stored actions (drawn by the rollout policy) is the mean KL to the reference on
        ``obs``, and its expected gradient that KL's gradient, for every ``ref_kl_direction`` and ``ref_kl_estimator``.

        :param obs: Observations of the minibatch
        :param actions: Its stored actions (as used by ``log_prob``)
        :param distribution: The current policy's distribution on ``obs``
        :param log_prob: ``log pi(a|s)`` of the stored actions
        :param old_log_prob: ``log pi_old(a|s)`` of the stored actions, from the rollout (needed by k1/k3)
        :param action_masks: Action masks of the states, if the policy uses some
        :return: a scalar
        """
        ref_params, ref_log_prob = self._reference_distribution(obs, actions, action_masks)
        return self._reference_kl(ref_params, distribution, log_prob, ref_log_prob, old_log_prob).mean()

    # ----------------------------------------------------------------------------------------------------------
    # After the update

    @th.no_grad()
    def _measure_reference_kl(self, chunk_size: int = 4096) -> np.ndarray:
        """
        One no-grad pass over the buffer with the updated policy (eval mode, as it will act) and the reference, the
        KL computed in float64 as the update's KL is.
        Analytic: the exact KL at each state. k1/k3: the importance-weighted estimate of :meth:`_reference_kl` at
        each state's stored action (drawn by the rollout policy), whose mean over the buffer is unbiased for the mean
        KL over its states.

        :return: the per-state reference KL
        """
        policy: ActorCriticPolicy = self.policy  # type: ignore[attr-defined]
        kls = []
        with acting_mode(policy):
            for data in self.rollout_buffer.ordered_samples(chunk_size):  # type: ignore[attr-defined]
                actions = self._actions_for_log_prob(data.actions)  # type: ignore[attr-defined]
                distribution = self._samples_distribution(policy, data)  # type: ignore[attr-defined]
                log_prob = distribution.log_prob(actions) if self.ref_kl_settings.estimator != "analytic" else None
                new_params = self.dist_params.extract(distribution)  # type: ignore[attr-defined]
                masks = self._sample_masks(data)  # type: ignore[attr-defined]
                ref_params, ref_log_prob = self._reference_distribution(data.observations, actions, masks)
                kls.append(self._reference_kl(*as_float64(ref_params, new_params, log_prob, ref_log_prob, data.old_log_prob)))
        return th.cat(kls).cpu().numpy()

    def _record_reference_kl(self) -> None:
        """
        Measure the KL to the reference after the update, log ``train/ref_kl``, ``train/ref_kl_p99`` and
        ``train/ref_kl_coef`` (and ``train/ref_target_kl``), then adapt beta_ref toward ``ref_target_kl``.
        No-op without a reference.
        """
        if self.ref_policy is None:
            return
        stats = kl_quantiles(self._measure_reference_kl(), (0.99,))
        logger = self.logger  # type: ignore[attr-defined]
        logger.record("train/ref_kl", stats["mean"])
        logger.record("train/ref_kl_p99", stats["p99"])
        logger.record("train/ref_kl_convention", self.ref_kl_settings.convention, exclude="tensorboard")
        if self.ref_target_kl is not None:
            logger.record("train/ref_target_kl", self.ref_target_kl)
        controller = self.ref_kl_controller
        if controller is not None and math.isfinite(stats["mean"]):
            if self.ref_target_kl is not None:
                controller.update(stats["mean"], self.ref_target_kl, self.n_steps * self.n_envs)  # type: ignore[attr-defined]
        logger.record("train/ref_kl_coef", self.ref_kl_coef)
