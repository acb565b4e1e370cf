"""This machine: its network, its cores and its allocator. The ground floor: imports only
`brigade.errors`.

    net.py     ports, endpoints (`parse_endpoint`, the one parser of HOST:PORT), the address to advertise
    cores.py   the cores a pipeline's ranks share where the host has fewer than they need
    malloc.py  glibc's malloc told to keep freed memory in a CPU training process
    peaks.py   what its devices do at their peak: known GPUs' dense FLOP/s, a CPU core's measured
"""
