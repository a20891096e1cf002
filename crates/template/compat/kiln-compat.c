/*
 * kiln-compat: a preload library installed in every template (/etc/ld.so.preload).
 *
 * gVisor releases before 2023 reject statx(2) calls that carry AT_NO_AUTOMOUNT with EINVAL,
 * and coreutils (ls, stat, …) always pass that flag, so `ls` fails inside such sandboxes.
 * This wrapper calls statx with the caller's flags and, only when that fails with EINVAL and
 * AT_NO_AUTOMOUNT was set, retries without it. Everywhere else the first call simply succeeds,
 * so behaviour is unchanged.
 *
 * Built with -nostdlib: it links against nothing, so it works with any glibc in the template;
 * the one libc symbol it uses (__errno_location) is resolved when it is loaded.
 */

#define KILN_SYS_STATX 332
#define KILN_AT_NO_AUTOMOUNT 0x800
#define KILN_EINVAL 22

extern int *__errno_location(void);

static long kiln_syscall5(long n, long a, long b, long c, long d, long e)
{
	register long r10 __asm__("r10") = d;
	register long r8 __asm__("r8") = e;
	long ret;
	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
			 : "rcx", "r11", "memory");
	return ret;
}

__attribute__((visibility("default"))) int statx(int dirfd, const char *path, int flags,
						   unsigned int mask, void *buf)
{
	long r = kiln_syscall5(KILN_SYS_STATX, dirfd, (long)path, flags, mask, (long)buf);
	if (r == -KILN_EINVAL && (flags & KILN_AT_NO_AUTOMOUNT))
		r = kiln_syscall5(KILN_SYS_STATX, dirfd, (long)path, flags & ~KILN_AT_NO_AUTOMOUNT,
				  mask, (long)buf);
	if (r < 0 && r > -4096) {
		*__errno_location() = (int)-r;
		return -1;
	}
	return (int)r;
}
