/* libmlx5.so.1 stand-in: the mlx5 direct-verbs functions the Mooncake CUDA wheels import. Those returning
 * int fail with -1; those returning an object pointer return NULL; mlx5dv_devx_free_uar (void in the real
 * library) returns -1, which its callers ignore. Symbol versions MLX5_1.2 / MLX5_1.7 as the wheels ask. */
#include "stub.h"

STUB_CODE(mlx5dv_init_obj, -1)
STUB_NULL(mlx5dv_devx_alloc_uar)
STUB_CODE(mlx5dv_devx_free_uar, -1)
STUB_CODE(mlx5dv_devx_general_cmd, -1)
STUB_NULL(mlx5dv_devx_obj_create)
STUB_CODE(mlx5dv_devx_obj_destroy, -1)
STUB_CODE(mlx5dv_devx_obj_modify, -1)
STUB_CODE(mlx5dv_devx_query_eqn, -1)
STUB_NULL(mlx5dv_devx_umem_reg)
STUB_CODE(mlx5dv_devx_umem_dereg, -1)
