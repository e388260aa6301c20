"""dslaunch: start a training script on one machine or many, and never leave a job stuck.

    dslaunch --nproc_per_node 4 train.py ...                 # this machine
    dslaunch --hostfile hosts [-i/-e SPEC] train.py ...      # several machines (pdsh or ssh)
    dslaunch --launcher slurm|openmpi ...                    # inside an allocation / with mpirun

`dslaunch` (launcher/cli.py, whose docstring is the full manual) resolves the hosts and slots,
starts one agent per node (`python -m launcher.agent`, launcher/agent.py; its dead man's switch,
launcher/deadman.py, kills the ranks' process groups if the agent is killed) through the chosen
runner (launcher/runners.py), hands them the control token and forwarded environment in a private
file rather than on a command line (launcher/handoff.py), and supervises them over an authenticated
control connection (launcher/control.py, launcher/supervisor.py). Each agent spawns its ranks with the standard environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT), prefixes their
output, stops the whole job at the first failure or hang, and `dslaunch` restarts it up to
`--max_restarts` times. This package never imports `engine`; the engine side of hang detection is
`engine/heartbeat.py`. docs/launcher.md describes the design.
"""
