"""Run one command inside a fresh cgroup-v1 memory cgroup, from a dropped page cache, and say
what it used.

  python3 dev/memcg_run.py --limit BYTES --out RUN.json [--disk-of PATH] [--no-drop] \
      [--stdout FILE] [--stderr FILE] -- COMMAND ARGS...

1. `sync; echo 3 > /proc/sys/vm/drop_caches` (root), so the command starts with none of its
   files cached (and no page charged to another cgroup that it could use for free).
2. A child of this process's own memory cgroup (from /proc/self/cgroup) with
   memory.limit_in_bytes = BYTES. The command is forked, moves itself into it (cgroup.procs)
   and execs, so everything it touches is charged there: anonymous memory and the page cache
   it reads (mmap faults included). Past the limit the kernel reclaims the cgroup's page cache,
   and kills the command (cgroup OOM) if its anonymous memory alone does not fit.
3. After it exits: wait4's rusage (peak RSS, blocks read), the cgroup's peak usage
   (memory.max_usage_in_bytes), failcnt, OOM kills, the page cache still charged to it
   (memory.stat `cache`, the proof that page cache was counted), /proc/diskstats' bytes read
   from the disk holding --disk-of during the run, wall time, and the load average before it.
   Then the cgroup is emptied (memory.force_empty) and removed.

RUN.json is written whatever the command's exit status; this script exits with the command's
status (128 + signal if it was killed). Standard library only. Used by
dev/qwen3-bigger-than-ram.sh; not part of .ci/run.
"""

import argparse
import json
import os
import sys
import time

MEMCG_ROOT = "/sys/fs/cgroup/memory"


def own_memcg() -> str:
    for line in open("/proc/self/cgroup"):
        _, controllers, path = line.rstrip("\n").split(":", 2)
        if "memory" in controllers.split(","):
            return MEMCG_ROOT + path
    raise SystemExit("no cgroup-v1 memory controller in /proc/self/cgroup")


def disk_name(path: str) -> str | None:
    dev = os.stat(path).st_dev
    sys_dev = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(sys_dev):
        return None
    name = os.path.basename(os.path.realpath(sys_dev))
    # a partition's reads are also counted on its disk; either line will do
    return name


def sectors_read(disk: str | None) -> int | None:
    if disk is None:
        return None
    for line in open("/proc/diskstats"):
        f = line.split()
        if f[2] == disk:
            return int(f[5])
    return None


def read(cg: str, name: str) -> str:
    with open(os.path.join(cg, name)) as f:
        return f.read()


def write(cg: str, name: str, value: str) -> None:
    with open(os.path.join(cg, name), "w") as f:
        f.write(value)


def memory_stat(cg: str) -> dict[str, int]:
    return {k: int(v) for k, v in (l.split() for l in read(cg, "memory.stat").splitlines())}


def oom_kills(cg: str) -> int | None:
    for line in read(cg, "memory.oom_control").splitlines():
        k, v = line.split()
        if k == "oom_kill":
            return int(v)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, required=True, help="memory.limit_in_bytes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--disk-of", help="count /proc/diskstats reads of the disk holding this path")
    ap.add_argument("--no-drop", action="store_true", help="do not drop the page cache first")
    ap.add_argument("--stdout")
    ap.add_argument("--stderr")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command")

    parent = own_memcg()
    cg = os.path.join(parent, f"memcg-run-{os.getpid()}")
    os.mkdir(cg)
    try:
        write(cg, "memory.limit_in_bytes", str(a.limit))
        limit = int(read(cg, "memory.limit_in_bytes"))
        if not a.no_drop:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        loadavg = open("/proc/loadavg").read().split()[:3]
        disk = disk_name(a.disk_of) if a.disk_of else None
        sectors0 = sectors_read(disk)
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                write(cg, "cgroup.procs", str(os.getpid()))
                if a.stdout:
                    fd = os.open(a.stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(fd, 1)
                if a.stderr:
                    fd = os.open(a.stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(fd, 2)
                os.execvp(cmd[0], cmd)
            except BaseException as e:  # noqa: BLE001 - the child must never return into main
                print(f"memcg_run: cannot start {cmd[0]}: {e}", file=sys.stderr)
            os._exit(127)
        _, status, ru = os.wait4(pid, 0)
        wall = time.monotonic() - t0
        sectors1 = sectors_read(disk)
        stat = memory_stat(cg)
        rc = os.waitstatus_to_exitcode(status)
        run = {
            "command": cmd,
            "exit_code": rc if rc >= 0 else None,
            "signal": -rc if rc < 0 else None,
            "wall_secs": wall,
            "loadavg_before": [float(x) for x in loadavg],
            "page_cache_dropped_before": not a.no_drop,
            # ru_maxrss is KiB on Linux; ru_inblock counts 512-byte units (the task's read_bytes)
            "peak_rss_bytes": ru.ru_maxrss * 1024,
            "read_bytes": ru.ru_inblock * 512,
            "user_secs": ru.ru_utime,
            "sys_secs": ru.ru_stime,
            "major_faults": ru.ru_majflt,
            "disk": disk,
            "disk_read_bytes": (sectors1 - sectors0) * 512 if disk and sectors0 is not None else None,
            "memcg": {
                "path": cg,
                "limit_bytes": limit,
                "max_usage_bytes": int(read(cg, "memory.max_usage_in_bytes")),
                "failcnt": int(read(cg, "memory.failcnt")),
                "oom_kills": oom_kills(cg),
                "cache_bytes_at_exit": stat.get("cache"),
                "rss_bytes_at_exit": stat.get("rss"),
                "mapped_file_bytes_at_exit": stat.get("mapped_file"),
            },
        }
        tmp = a.out + ".part"
        with open(tmp, "w") as f:
            json.dump(run, f, indent=1)
            f.write("\n")
        os.replace(tmp, a.out)
    finally:
        try:
            write(cg, "memory.force_empty", "0")
        except OSError:
            pass
        os.rmdir(cg)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
