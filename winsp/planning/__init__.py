"""Layer 2, planning: which rank owns which rows in every layer, as pure functions of shapes.

Every rank computes the same plans from the same grids with no communication: the LPT placement
(:mod:`~winsp.planning.plan`), split-window and head placements (:mod:`~winsp.planning.balance`), the locality
placement (:mod:`~winsp.planning.locality`), neighborhood halos (:mod:`~winsp.planning.halo`), a whole layer schedule
(:mod:`~winsp.planning.schedule`) and hierarchies of stages (:mod:`~winsp.planning.stages`,
:mod:`~winsp.planning.hierarchy`). The cost constants they weigh live in :mod:`~winsp.planning.costs`.
"""

from winsp.planning.costs import DEFAULT_COSTS, GLOO_CPU_COSTS, CostConstants
from winsp.planning.plan import PLANNER_VERSION, Plan, lpt_assign
from winsp.planning.schedule import PLANNERS, plan_schedule
from winsp.planning.stages import Stage, stage_grids

__all__ = ["Plan", "lpt_assign", "PLANNER_VERSION", "PLANNERS", "plan_schedule", "Stage", "stage_grids",
           "CostConstants", "DEFAULT_COSTS", "GLOO_CPU_COSTS"]
