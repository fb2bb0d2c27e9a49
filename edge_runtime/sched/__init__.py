"""Iteration scheduling: tasks and policies (MACE and the baselines), the bin each iteration
fills, the cost model that prices its work, and fine-tune jobs as the scheduler sees them."""
