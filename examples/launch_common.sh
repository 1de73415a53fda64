# Shared tail of the launch scripts in examples/: sourced, not run.
#
# Each script sets GPUS_PER_NODE, NUM_NODES and its argument arrays, then calls
#   launch <entry script> <flags...>
# which starts torchrun on this node (run the same script on every node: NODE_RANK, MASTER_ADDR
# and MASTER_PORT say where this node is in the job, as in Megatron's examples; on one node
# without MASTER_PORT, torchrun --standalone picks a free port), or, with
# MEGATRON_LITE_CHECK_ARGS=1, only validates the flags for the full world size of
# NUM_NODES x GPUS_PER_NODE processes in one CPU process and exits (no GPU, no data needed).

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}

launch() {
    local entry=$1
    shift
    # NODE_RANK 1 with the default NUM_NODES 1 would start a second, independent one-node job (and
    # both would write the same checkpoints): refuse it, as any bad launch setting (exit code 2)
    if ! [[ "$NUM_NODES" =~ ^[1-9][0-9]*$ && "$NODE_RANK" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NUM_NODES" ]; then
        echo "$(basename "$0"): error: NODE_RANK $NODE_RANK is not a node of NUM_NODES $NUM_NODES; set NUM_NODES to the" \
             "number of nodes (the same on every node) and NODE_RANK to 0..NUM_NODES-1" >&2
        exit 2
    fi
    if [ "${MEGATRON_LITE_CHECK_ARGS:-0}" != 0 ]; then
        WORLD_SIZE=$((NUM_NODES * GPUS_PER_NODE)) exec "${PYTHON:-python3}" "$REPO/$entry" "$@"
    fi
    export CUDA_DEVICE_MAX_CONNECTIONS=1  # keep communication kernels ordered with compute
    if [ "$NUM_NODES" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then  # one node: a free port, no clash with other jobs
        exec torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" "$REPO/$entry" "$@"
    fi
    exec torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node-rank "$NODE_RANK" \
        --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-6000}" "$REPO/$entry" "$@"
}
