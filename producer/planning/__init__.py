"""planning"""

from producer.planning.planner import PlanContext, plan_file, preprocess_examples, write_plan

__all__ = ["PlanContext", "plan_file", "preprocess_examples", "write_plan"]
