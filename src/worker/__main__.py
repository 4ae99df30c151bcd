"""``python -m mlxrt.worker``: one MLX worker process, driven over its stdin."""

from .main import main

if __name__ == "__main__":
    main()
