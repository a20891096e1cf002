/* kiln-vmm test guest: boot stub (Intel syntax, assembled by rustc's global_asm!).
 *
 * Two entry points, both reached through the VMM's real boot path:
 *   _start32_pvh  PVH entry (32-bit protected mode, paging off, %ebx = hvm_start_info), announced
 *                 by the XEN_ELFNOTE_PHYS32_ENTRY note below (only linked into the PVH variant);
 *   _start64      64-bit Linux boot protocol entry (long mode, VMM page tables, %rsi = zero page).
 * Both load the guest's own static page tables (4 GiB identity map, user-accessible), enable SSE,
 * load a GDT with ring-3 segments and `iretq` to ring 3 with IOPL=3, so the Rust workload runs in
 * guest user mode (native speed under PVM) and can still do port I/O. Kernel-mode work is a few
 * dozen instructions. */

.section .note.pvh, "a"
.p2align 2
.long 4
.long 4
.long 18
.asciz "Xen"
.long _start32_pvh

.section .text.boot, "ax"
.code32
.global _start32_pvh
_start32_pvh:
    mov esp, offset kiln_user_stack_top
    mov dword ptr [kiln_boot_kind], 2
    mov dword ptr [kiln_boot_info], ebx
    mov eax, cr4
    or eax, 0x620
    mov cr4, eax
    mov eax, offset kiln_pml4
    mov cr3, eax
    mov ecx, 0xC0000080
    rdmsr
    or eax, 0x100
    wrmsr
    mov eax, cr0
    and eax, 0xFFFFFFFB
    or eax, 0x80000003
    mov cr0, eax
    lgdt [kiln_gdt_ptr]
    push 0x08
    mov eax, offset kiln_long_entry
    push eax
    retf

.code64
.global _start64
_start64:
    lea rsp, [rip + kiln_user_stack_top]
    mov dword ptr [rip + kiln_boot_kind], 1
    mov qword ptr [rip + kiln_boot_info], rsi
    mov rax, cr4
    or rax, 0x620
    mov cr4, rax
    lea rax, [rip + kiln_pml4]
    mov cr3, rax
    mov rax, cr0
    and rax, 0xFFFFFFFFFFFFFFFB
    or rax, 2
    mov cr0, rax
    lgdt [rip + kiln_gdt_ptr]
    push 0x08
    lea rax, [rip + kiln_long_entry]
    push rax
    retfq

kiln_long_entry:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    push 0x1b
    lea rax, [rip + kiln_user_stack_top]
    push rax
    push 0x3002
    push 0x23
    lea rax, [rip + kiln_user_entry]
    push rax
    iretq

kiln_user_entry:
    mov edi, dword ptr [rip + kiln_boot_kind]
    mov rsi, qword ptr [rip + kiln_boot_info]
    call kiln_guest_main
    ud2

.section .data.boot, "aw"
.p2align 4
.global kiln_boot_kind
kiln_boot_kind: .quad 0
.global kiln_boot_info
kiln_boot_info: .quad 0
kiln_gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF
    .quad 0x00CF92000000FFFF
    .quad 0x00CFF2000000FFFF
    .quad 0x00AFFA000000FFFF
kiln_gdt_end:
kiln_gdt_ptr:
    .word kiln_gdt_end - kiln_gdt - 1
    .quad kiln_gdt

.p2align 12
kiln_pml4:
    .quad kiln_pdpt + 7
    .fill 511, 8, 0
kiln_pdpt:
    .quad kiln_pd + 7
    .quad kiln_pd + 0x1007
    .quad kiln_pd + 0x2007
    .quad kiln_pd + 0x3007
    .fill 508, 8, 0
kiln_pd:
    .set kiln_i, 0
    .rept 2048
    .quad (kiln_i << 21) | 0x87
    .set kiln_i, kiln_i + 1
    .endr

.section .bss.stack, "aw", @nobits
.p2align 12
kiln_user_stack:
    .skip 65536
kiln_user_stack_top:
