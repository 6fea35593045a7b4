"""TFF execution contexts and the processes they run on: local and remote C++ workers."""
