"""The `kvroute` commands: the top layer, which starts and wires the processes (router/, worker/, gateway/) and
talks to them; nothing below imports it."""
