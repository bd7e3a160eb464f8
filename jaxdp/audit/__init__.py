"""Empirical privacy auditing: lower bounds on ε that check the accountants' upper bounds.

* :func:`epsilon_lower_bound`: from scores of many runs with and without a canary, the
  (ε, δ) lower bound of a threshold test with Clopper–Pearson intervals;
* :func:`empirical_tradeoff`: the threshold tests' (FPR, TPR) points with confidence boxes,
  to draw beside :func:`jaxdp.accounting.tradeoff`;
* :func:`one_run_epsilon_lower_bound`, :func:`one_run_audit`: one training run with many
  canaries (Steinke, Nasr & Jagielski 2023);
* drivers, vectorised with ``vmap`` over runs, that audit the Gaussian and Poisson-sampled
  Gaussian mechanisms, PNSGD (per record position, last iterate only) and DP-SGD with a
  gradient canary against the accountant's claim.

A lower bound above the claimed ε (at the stated confidence) means the claim is wrong.
"""

from ._bounds import EmpiricalTradeoff as EmpiricalTradeoff
from ._bounds import EpsilonLowerBound as EpsilonLowerBound
from ._bounds import clopper_pearson as clopper_pearson
from ._bounds import empirical_tradeoff as empirical_tradeoff
from ._bounds import epsilon_lower_bound as epsilon_lower_bound
from ._one_run import OneRunLowerBound as OneRunLowerBound
from ._one_run import one_run_audit as one_run_audit
from ._one_run import one_run_epsilon_lower_bound as one_run_epsilon_lower_bound
from ._one_run import one_run_p_value as one_run_p_value

__all__ = [
    "EmpiricalTradeoff",
    "EpsilonLowerBound",
    "OneRunLowerBound",
    "clopper_pearson",
    "empirical_tradeoff",
    "epsilon_lower_bound",
    "one_run_audit",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
]

from ._drivers import AuditResult as AuditResult
from ._drivers import __all__ as _DRIVERS
from ._drivers import audit_dpsgd as audit_dpsgd
from ._drivers import audit_dpsgd_one_run as audit_dpsgd_one_run
from ._drivers import audit_gaussian as audit_gaussian
from ._drivers import audit_pnsgd as audit_pnsgd
from ._drivers import dpsgd_one_run_scores as dpsgd_one_run_scores
from ._drivers import dpsgd_scores as dpsgd_scores
from ._drivers import gaussian_scores as gaussian_scores
from ._drivers import pnsgd_scores as pnsgd_scores

__all__ += _DRIVERS
