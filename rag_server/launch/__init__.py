"""Starting the SGLang runtime behind the frontend, and `picrag serve` as a child process."""
