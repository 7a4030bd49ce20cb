"""LoGRA: low-rank gradient sketches, their optax transformations and the predicted KL."""
from logra_jax.sketch.compress import (low_rank_reconstruct, randomized_svd_compress,
                                       sparse_mask_sketch, sparse_mask_tree)
from logra_jax.sketch.dense import (COPROBE, COPROJECTION, PROBE, PROJECTION, SketchDense,
                                    cosketch_matmul, sketch_matmul, sketch_matmul_linear)
from logra_jax.sketch.kl import (chunked_kl_coefficient, chunked_mean_kl, effective_budget,
                                 finite_difference_kl_at_budget,
                                 finite_difference_kl_coefficient, kl_budget_schedule,
                                 kl_coefficient, logits_and_tangents, mean_kl,
                                 position_kl, position_variance, predicted_kl_coefficient,
                                 step_scale)
from logra_jax.sketch.momentum import (SketchMomentumState, basis_transfer,
                                       scale_by_sketch_momentum, transfer_moments)
from logra_jax.sketch.projection import (name_hash, projection_checksum, projection_key,
                                         sample_projection)
from logra_jax.sketch.rank import RankRules, dynamic_rank, heuristic_rank
from logra_jax.sketch.subspace import adaptive_projection, orthonormal_columns
from logra_jax.sketch.transform import (SKETCH_OPTIMIZERS, RelativeStepState, RowAdamState,
                                        SketchAdamState, logra, scale_by_relative_step,
                                        scale_by_row_adam, scale_by_sketch_adam,
                                        scale_by_sketch_sgd)
from logra_jax.sketch.tree import (DEFAULT_TARGETS, kernels_of, make_projections, rest_of,
                                   select, sketch_value_and_grad, sketch_variables,
                                   stacked_name, target_paths, with_rest, zero_coprobes,
                                   zero_probes)
from logra_jax.sketch.update import (apply_dense_updates, apply_sketch_updates, expand_update,
                                     update_sq_norm)
