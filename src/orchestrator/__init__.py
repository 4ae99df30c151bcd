"""The application's side: start, supervise and talk to MLX workers. Never imports MLX."""
